//! The pure parts of `coll-bench traffic`: where a rank lives, the ring allgatherv schedule and
//! what it sends across nodes, the minimum inter-node traffic of an allgather, the SP counters
//! read from `service-process stats --json`, and the table of traffic rows.
//!
//! Placement follows `bootstrap::cluster::Cluster::placement` (this crate is an ordinary MPI
//! program and does not link the SP crates): world rank `r` of `P` ranks on `N` nodes with `R`
//! ranks per node is on node `r / R` (block) or `r % N` (cyclic); `R` defaults to
//! `ceil(P / N)`.

use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Block,
    Cyclic,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::Block => "block",
            Layout::Cyclic => "cyclic",
        }
    }

    pub fn parse(s: &str) -> Result<Layout, String> {
        match s.trim() {
            "block" => Ok(Layout::Block),
            "cyclic" => Ok(Layout::Cyclic),
            other => Err(format!(
                "unknown layout {other:?} (expected block or cyclic)"
            )),
        }
    }
}

/// How world ranks are spread over nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeMap {
    pub nodes: u32,
    /// `None`: `ceil(world size / nodes)`.
    pub ranks_per_node: Option<u32>,
    pub layout: Layout,
}

impl NodeMap {
    /// From the values the launcher exports (`SPOFF_NODES`, `SPOFF_RANKS_PER_NODE`,
    /// `SPOFF_LAYOUT`); an absent value means one node, `ceil(P / nodes)` ranks per node, block.
    pub fn from_env_values(
        nodes: Option<&str>,
        ranks_per_node: Option<&str>,
        layout: Option<&str>,
    ) -> Result<NodeMap, String> {
        let positive = |name: &str, v: &str| {
            v.trim()
                .parse::<u32>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{name}={v:?} is not a positive integer"))
        };
        Ok(NodeMap {
            nodes: nodes.map_or(Ok(1), |v| positive("SPOFF_NODES", v))?,
            ranks_per_node: ranks_per_node
                .map(|v| positive("SPOFF_RANKS_PER_NODE", v))
                .transpose()?,
            layout: layout.map_or(Ok(Layout::Block), Layout::parse)?,
        })
    }

    /// From the cluster description the launcher writes (the JSON of `bootstrap::Cluster`):
    /// its `nodes`, `ranks_per_node` and `layout` fields, and how many SPs it lists.
    pub fn from_cluster_json(text: &str) -> Result<(NodeMap, usize), String> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| format!("cluster description: {e}"))?;
        let nodes = v["nodes"]
            .as_u64()
            .filter(|&n| n > 0 && n <= u32::MAX as u64)
            .ok_or("cluster description: no positive \"nodes\"")? as u32;
        let ranks_per_node = match &v["ranks_per_node"] {
            Value::Null => None,
            r => Some(
                r.as_u64()
                    .filter(|&n| n > 0 && n <= u32::MAX as u64)
                    .ok_or("cluster description: \"ranks_per_node\" is not a positive integer")?
                    as u32,
            ),
        };
        let layout = Layout::parse(
            v["layout"]
                .as_str()
                .ok_or("cluster description: no \"layout\"")?,
        )?;
        let sps = v["sps"]
            .as_array()
            .ok_or("cluster description: no \"sps\" list")?
            .len();
        Ok((
            NodeMap {
                nodes,
                ranks_per_node,
                layout,
            },
            sps,
        ))
    }

    /// The node of every world rank of a job of `size` ranks (index = world rank).
    pub fn nodes_of(&self, size: u32) -> Result<Vec<u32>, String> {
        let r = self
            .ranks_per_node
            .unwrap_or_else(|| size.div_ceil(self.nodes))
            .max(1);
        (0..size)
            .map(|rank| {
                let node = match self.layout {
                    Layout::Block => rank / r,
                    Layout::Cyclic => rank % self.nodes,
                };
                if node >= self.nodes {
                    Err(format!(
                        "rank {rank} of {size} falls on node {node}, but there are {} nodes of \
                         {r} ranks",
                        self.nodes
                    ))
                } else {
                    Ok(node)
                }
            })
            .collect()
    }
}

/// Step `s` (0-based, `P - 1` steps) of the ring allgatherv at rank `me` of `p`: the block it
/// sends to `me + 1` (the one it received in the previous step, its own at step 0) and the
/// block it receives from `me - 1`.
pub fn ring_step(me: usize, p: usize, s: usize) -> (usize, usize) {
    let send = (me + p - s % p) % p;
    let recv = (me + 2 * p - s % p - 1) % p;
    (send, recv)
}

/// Counts what one rank sends to ranks of other nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InterNodeCounter {
    pub bytes: u64,
}

impl InterNodeCounter {
    /// Records a send of `len` bytes from world rank `from` to `to` under `node_of`.
    pub fn sent(&mut self, node_of: &[u32], from: usize, to: usize, len: u64) {
        if node_of[from] != node_of[to] {
            self.bytes += len;
        }
    }
}

/// What the ring allgatherv sends across nodes in one call, summed over ranks: every rank runs
/// the schedule of [`ring_step`] and counts with an [`InterNodeCounter`], as the MPI run does.
/// `counts[j]` is rank `j`'s block in bytes.
pub fn ring_inter_node_bytes(node_of: &[u32], counts: &[u64]) -> u64 {
    let p = node_of.len();
    (0..p)
        .map(|me| {
            let mut c = InterNodeCounter::default();
            for s in 0..p.saturating_sub(1) {
                let (send, _) = ring_step(me, p, s);
                c.sent(node_of, me, (me + 1) % p, counts[send]);
            }
            c.bytes
        })
        .sum()
}

/// The least an allgather must move between nodes: every rank's block enters every other node
/// that has members once, i.e. the sum of the blocks times (nodes with members - 1).
pub fn min_inter_node_bytes(node_of: &[u32], counts: &[u64]) -> u64 {
    let mut nodes: Vec<u32> = node_of.to_vec();
    nodes.sort_unstable();
    nodes.dedup();
    let total: u64 = counts.iter().sum();
    total * (nodes.len() as u64).saturating_sub(1)
}

/// The SP counters that matter here, summed over the SPs of a cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpTotals {
    pub sps: usize,
    pub posts: u64,
    pub bytes_inter_node: u64,
}

impl SpTotals {
    /// Sums the JSON lines of `service-process stats --json` (one object per SP, with an `sp`
    /// field). With `expect_sps`, every SP must have answered exactly once.
    pub fn parse(output: &str, expect_sps: Option<usize>) -> Result<SpTotals, String> {
        let mut t = SpTotals::default();
        let mut seen = Vec::new();
        for (i, line) in output.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(line)
                .map_err(|e| format!("stats line {}: not JSON: {e}", i + 1))?;
            let field = |f: &str| {
                v[f].as_u64()
                    .ok_or_else(|| format!("stats line {}: no counter {f:?}", i + 1))
            };
            seen.push(field("sp")?);
            t.posts += field("posts")?;
            t.bytes_inter_node += field("bytes_inter_node")?;
            t.sps += 1;
        }
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err("an SP answered twice".into());
        }
        if let Some(n) = expect_sps {
            if t.sps != n {
                return Err(format!("{} of {n} SPs answered", t.sps));
            }
        }
        Ok(t)
    }

    /// `self - before`, or an error if a counter went down (an SP restarted).
    pub fn since(&self, before: &SpTotals) -> Result<SpTotals, String> {
        let d = |a: u64, b: u64, f: &str| {
            a.checked_sub(b)
                .ok_or_else(|| format!("counter {f} went down ({b} -> {a})"))
        };
        Ok(SpTotals {
            sps: self.sps,
            posts: d(self.posts, before.posts, "posts")?,
            bytes_inter_node: d(
                self.bytes_inter_node,
                before.bytes_inter_node,
                "bytes_inter_node",
            )?,
        })
    }
}

/// `total / iters` as a JSON number: an integer when it divides exactly.
pub fn per_call(total: u64, iters: u32) -> Value {
    let iters = iters.max(1) as u64;
    // (not `is_multiple_of`: the workspace supports Rust 1.80)
    let rest = total % iters;
    if rest == 0 {
        Value::from(total / iters)
    } else {
        Value::from(total as f64 / iters as f64)
    }
}

/// Renders rows of `coll-bench traffic --json` (any number of files, concatenated) as a table:
/// coll, ranks, nodes, layout, bytes, the three traffic figures, the two ratios to the minimum
/// and whether the run validated. A missing (null) figure shows as `-` and the reason, if the
/// row gives one, is listed under the table. Returns the text and whether every row validated.
pub fn render_table(rows: &[Value], markdown: bool) -> (String, bool) {
    let header = [
        "coll",
        "ranks",
        "nodes",
        "layout",
        "bytes",
        "ring_B",
        "offload_B",
        "min_B",
        "ring/min",
        "offload/min",
        "validated",
    ];
    let num = |r: &Value, f: &str| r[f].as_f64();
    let bytes = |v: Option<f64>| match v {
        Some(v) if v.fract() == 0.0 => format!("{}", v as u64),
        Some(v) => format!("{v:.1}"),
        None => "-".into(),
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    let mut ok = true;
    let mut notes = Vec::new();
    let lines: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let valid = r["validated"] == true;
            ok &= valid;
            let (ring, off, min) = (
                num(r, "ring_inter_node_bytes"),
                num(r, "offload_inter_node_bytes"),
                num(r, "min_inter_node_bytes"),
            );
            let layout = r["layout"].as_str().unwrap_or("?").to_string();
            let b = r["bytes"].as_u64().map_or("?".into(), |b| b.to_string());
            if let Some(why) = r["offload_note"].as_str() {
                notes.push(format!("{layout} {b} bytes: no offload_B: {why}"));
            }
            vec![
                r["coll"].as_str().unwrap_or("?").to_string(),
                r["ranks"].to_string(),
                r["nodes"].to_string(),
                layout,
                b,
                bytes(ring),
                bytes(off),
                bytes(min),
                ratio(ring, min),
                ratio(off, min),
                valid.to_string(),
            ]
        })
        .collect();
    let mut out = String::new();
    if markdown {
        out += &crate::table::markdown(&header, &lines);
        for n in &notes {
            out += &format!("\n- {n}");
        }
        if !notes.is_empty() {
            out += "\n";
        }
    } else {
        out += &crate::table::aligned(&header, &lines);
        for n in &notes {
            out += &format!("# {n}\n");
        }
    }
    (out, ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(nodes: u32, rpn: u32, layout: Layout) -> Vec<u32> {
        NodeMap {
            nodes,
            ranks_per_node: Some(rpn),
            layout,
        }
        .nodes_of(nodes * rpn)
        .unwrap()
    }

    #[test]
    fn placement_matches_the_cluster_formula() {
        assert_eq!(map(2, 2, Layout::Block), vec![0, 0, 1, 1]);
        assert_eq!(map(2, 2, Layout::Cyclic), vec![0, 1, 0, 1]);
        assert_eq!(map(3, 2, Layout::Cyclic), vec![0, 1, 2, 0, 1, 2]);
        // Default ranks per node: ceil(P / N); a rank beyond the last node is an error.
        let m = NodeMap::from_env_values(Some("2"), None, Some("block")).unwrap();
        assert_eq!(m.nodes_of(3).unwrap(), vec![0, 0, 1]);
        let too_many = NodeMap::from_env_values(Some("2"), Some("1"), None).unwrap();
        assert!(too_many.nodes_of(3).is_err());
        // Nothing set: one node.
        let none = NodeMap::from_env_values(None, None, None).unwrap();
        assert_eq!(none.nodes_of(4).unwrap(), vec![0; 4]);
        assert!(NodeMap::from_env_values(Some("0"), None, None).is_err());
        assert!(NodeMap::from_env_values(None, None, Some("round")).is_err());
    }

    #[test]
    fn cluster_json() {
        let text = r#"{"nodes":2,"sps_per_node":1,"ranks_per_node":2,"layout":"cyclic",
            "sps":[{"id":0},{"id":1}]}"#;
        let (m, sps) = NodeMap::from_cluster_json(text).unwrap();
        assert_eq!(
            m,
            NodeMap {
                nodes: 2,
                ranks_per_node: Some(2),
                layout: Layout::Cyclic
            }
        );
        assert_eq!(sps, 2);
        let no_rpn = r#"{"nodes":2,"ranks_per_node":null,"layout":"block","sps":[]}"#;
        assert_eq!(
            NodeMap::from_cluster_json(no_rpn).unwrap().0.ranks_per_node,
            None
        );
        assert!(NodeMap::from_cluster_json("{}").is_err());
    }

    /// Runs the ring schedule on in-memory buffers: every rank ends with every block, and what
    /// a rank sends at step s is what it received at step s - 1.
    #[test]
    fn ring_schedule_delivers_every_block() {
        for p in 1..7 {
            let mut have: Vec<Vec<bool>> =
                (0..p).map(|r| (0..p).map(|j| j == r).collect()).collect();
            for s in 0..p - 1 {
                let sent: Vec<usize> = (0..p).map(|r| ring_step(r, p, s).0).collect();
                for r in 0..p {
                    assert!(
                        have[r][sent[r]],
                        "p={p} s={s}: rank {r} sends a block it lacks"
                    );
                    if s > 0 {
                        assert_eq!(sent[r], ring_step(r, p, s - 1).1);
                    }
                    let right = (r + 1) % p;
                    assert_eq!(ring_step(right, p, s).1, sent[r], "receiver disagrees");
                    have[right][sent[r]] = true;
                }
            }
            assert!(have.iter().all(|h| h.iter().all(|&b| b)), "p={p}");
        }
    }

    #[test]
    fn counter_counts_only_other_nodes() {
        let nodes = [0, 0, 1];
        let mut c = InterNodeCounter::default();
        c.sent(&nodes, 0, 1, 10);
        assert_eq!(c.bytes, 0);
        c.sent(&nodes, 1, 2, 10);
        c.sent(&nodes, 2, 0, 5);
        assert_eq!(c.bytes, 15);
    }

    #[test]
    fn ring_traffic_depends_on_the_layout() {
        let b = 1000u64;
        let eq = |p: usize| vec![b; p];
        // 2 x 2 block: links 1->2 and 3->0 cross, 3 blocks each.
        assert_eq!(
            ring_inter_node_bytes(&map(2, 2, Layout::Block), &eq(4)),
            6 * b
        );
        // 2 x 2 cyclic: all 4 links cross.
        assert_eq!(
            ring_inter_node_bytes(&map(2, 2, Layout::Cyclic), &eq(4)),
            12 * b
        );
        // One node: nothing crosses.
        assert_eq!(ring_inter_node_bytes(&[0, 0, 0], &eq(3)), 0);
        // Unequal blocks: rank r sends every block but its right neighbour's.
        let counts = [1, 2, 4, 8];
        assert_eq!(
            ring_inter_node_bytes(&[0, 0, 1, 1], &counts),
            (15 - 4) + (15 - 1)
        );
        // N nodes x R ranks, block: N links cross, each carries P - 1 blocks.
        assert_eq!(
            ring_inter_node_bytes(&map(4, 3, Layout::Block), &eq(12)),
            4 * 11 * b
        );
        assert_eq!(ring_inter_node_bytes(&[0], &[5]), 0);
    }

    #[test]
    fn minimum_formula() {
        let b = 1000u64;
        assert_eq!(
            min_inter_node_bytes(&map(2, 2, Layout::Block), &[b; 4]),
            4 * b
        );
        assert_eq!(
            min_inter_node_bytes(&map(2, 2, Layout::Cyclic), &[b; 4]),
            4 * b
        );
        assert_eq!(
            min_inter_node_bytes(&map(4, 3, Layout::Cyclic), &[b; 12]),
            12 * b * 3
        );
        // Nodes without members do not count.
        assert_eq!(min_inter_node_bytes(&[0, 0, 3], &[1, 2, 4]), 7);
        assert_eq!(min_inter_node_bytes(&[2, 2], &[1, 2]), 0);
    }

    #[test]
    fn stats_lines() {
        let out =
            "{\"sp\":0,\"posts\":4,\"bytes_inter_node\":100,\"bytes_intra_node\":7,\"x\":1}\n\
                   {\"sp\":1,\"posts\":2,\"bytes_inter_node\":50,\"bytes_intra_node\":3}\n";
        let t = SpTotals::parse(out, Some(2)).unwrap();
        assert_eq!(
            t,
            SpTotals {
                sps: 2,
                posts: 6,
                bytes_inter_node: 150,
            }
        );
        assert!(SpTotals::parse(out, Some(3))
            .unwrap_err()
            .contains("2 of 3"));
        assert!(SpTotals::parse("{\"sp\":0}", None).is_err());
        assert!(SpTotals::parse("not json", None).is_err());
        let twice =
            "{\"sp\":0,\"posts\":0,\"bytes_inter_node\":0,\"bytes_intra_node\":0}\n".repeat(2);
        assert!(SpTotals::parse(&twice, None).is_err());
        let before = SpTotals {
            sps: 2,
            posts: 1,
            bytes_inter_node: 40,
        };
        let d = t.since(&before).unwrap();
        assert_eq!((d.posts, d.bytes_inter_node), (5, 110));
        assert!(before.since(&t).is_err());
    }

    #[test]
    fn per_call_is_exact_when_it_can_be() {
        assert_eq!(per_call(400, 4), serde_json::json!(100));
        assert_eq!(per_call(10, 4), serde_json::json!(2.5));
    }

    #[test]
    fn table() {
        let rows: Vec<Value> = [
            r#"{"coll":"allgatherv","bytes":1024,"ranks":4,"nodes":2,"layout":"block","ring_inter_node_bytes":6144,"offload_inter_node_bytes":4096,"min_inter_node_bytes":4096,"validated":true}"#,
            r#"{"coll":"allgatherv","bytes":1024,"ranks":4,"nodes":2,"layout":"cyclic","ring_inter_node_bytes":12288,"offload_inter_node_bytes":null,"min_inter_node_bytes":4096,"validated":false,"offload_note":"native run"}"#,
        ]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
        let (md, ok) = render_table(&rows, true);
        assert!(!ok);
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(
            lines[0],
            "| coll | ranks | nodes | layout | bytes | ring_B | offload_B | min_B | ring/min | \
             offload/min | validated |"
        );
        assert_eq!(lines[1], "|---|---|---|---|---|---|---|---|---|---|---|");
        assert_eq!(
            lines[2],
            "| allgatherv | 4 | 2 | block | 1024 | 6144 | 4096 | 4096 | 1.50 | 1.00 | true |"
        );
        assert_eq!(
            lines[3],
            "| allgatherv | 4 | 2 | cyclic | 1024 | 12288 | - | 4096 | 3.00 | - | false |"
        );
        assert!(md.contains("- cyclic 1024 bytes: no offload_B: native run"));
        let (txt, _) = render_table(&rows[..1], false);
        let t: Vec<&str> = txt.lines().collect();
        assert_eq!(t.len(), 2);
        assert!(t[1].ends_with("1.50        1.00      true"), "{}", t[1]);
        // A minimum of 0 (one node) has no ratio.
        let one: Value = serde_json::from_str(
            r#"{"layout":"block","bytes":8,"ring_inter_node_bytes":0,"offload_inter_node_bytes":0,"min_inter_node_bytes":0,"validated":true}"#,
        )
        .unwrap();
        let (md, ok) = render_table(&[one], true);
        assert!(ok);
        assert!(md
            .lines()
            .nth(2)
            .unwrap()
            .contains("| 0 | 0 | 0 | - | - | true |"));
    }
}
