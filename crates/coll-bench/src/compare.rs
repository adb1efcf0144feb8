//! `coll-bench compare`: a native run and one or more offloaded runs side by side (see
//! `coll-bench compare --help`).

use clap::Args;
use coll_bench::table;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// JSON Lines file of the native run.
    #[arg(long, value_name = "FILE")]
    native: PathBuf,

    /// JSON Lines file of an offloaded run; repeat for one column group per file.
    #[arg(long, value_name = "FILE", required = true)]
    pub offload: Vec<PathBuf>,

    /// Print a Markdown table instead of plain text.
    #[arg(long)]
    markdown: bool,
}

pub fn read_rows(path: &PathBuf) -> Result<Vec<serde_json::Value>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .map_err(|e| format!("{}:{}: not JSON: {e}", path.display(), i + 1))
        })
        .collect()
}

type Json = serde_json::Value;

/// A `compare` row key: (coll, bytes, delay_ms, design); delay_ms is 0 for `overlap` rows.
type Key = (String, u64, u64, Option<String>);

fn key_of(r: &Json) -> Key {
    (
        r["coll"].as_str().unwrap_or("?").to_string(),
        r["bytes"].as_u64().unwrap_or(0),
        r["delay_ms"].as_u64().unwrap_or(0),
        r["design"].as_str().map(String::from),
    )
}

/// The key without the design: the measured point.
fn point_of(k: &Key) -> (&str, u64, u64) {
    (&k.0, k.1, k.2)
}

fn num(r: Option<&Json>, f: &str) -> Option<f64> {
    r.and_then(|r| r[f].as_f64())
}

/// Time the host spent in the collective's calls while it had compute to do.
fn host_us(r: Option<&Json>) -> Option<f64> {
    Some(num(r, "post_us")? + num(r, "wait_us")?)
}

fn cell(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".to_string(), |v| format!("{v:.prec$}"))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn validated(r: Option<&Json>) -> bool {
    r.is_some_and(|r| r["validated"] == true)
}

/// Rows of `late` runs carry tail_us and a delay; rows of `overlap` runs do not.
fn is_late<'a>(rows: impl IntoIterator<Item = &'a Json>) -> bool {
    rows.into_iter().any(|r| r.get("tail_us").is_some())
}

/// "ranks=.. nodes=.. mode=.." of a file's first row.
fn run_context(rows: &[Json]) -> String {
    rows.first().map_or("-".to_string(), |r| {
        format!(
            "ranks={} nodes={} mode={}",
            r["ranks"],
            r["nodes"],
            r["mode"].as_str().unwrap_or("?")
        )
    })
}

/// The table: a line naming each side with its context, then the header and the lines, as
/// right-aligned plain text or as Markdown.
fn render_compare(
    sides: &[(String, String)],
    legend: &str,
    header: &[String],
    lines: &[Vec<String>],
    markdown: bool,
) -> String {
    let sides = sides
        .iter()
        .map(|(name, ctx)| format!("{name}: {ctx}"))
        .collect::<Vec<_>>()
        .join("; ");
    if markdown {
        let mut chars = sides.chars();
        let first: String = chars
            .next()
            .map(|c| c.to_uppercase().collect())
            .unwrap_or_default();
        format!("{first}{}. {legend}\n\n", chars.as_str()) + &table::markdown(header, lines)
    } else {
        format!("# {sides}; {legend}\n") + &table::aligned(header, lines)
    }
}

/// One native and one offloaded file, joined on (coll, bytes, delay_ms, design); returns the
/// table and whether every row is on both sides and validated.
fn compare_one(native: &[Json], offload: &[Json], markdown: bool) -> (String, bool) {
    fn find<'a>(rows: &'a [Json], k: &Key) -> Option<&'a Json> {
        rows.iter().find(|r| key_of(r) == *k)
    }
    let late = is_late(native.iter().chain(offload));
    let show_design = native
        .iter()
        .chain(offload)
        .any(|r| r["design"].is_string());
    let mut offload_keys: Vec<Key> = offload.iter().map(key_of).collect();
    offload_keys.sort();
    offload_keys.dedup();
    // An offload key the native file lacks takes the native rows of the same point if they
    // have a single design (natively the design changes nothing).
    let stand_in = |k: &Key| {
        let mut same = native
            .iter()
            .filter(|r| point_of(&key_of(r)) == point_of(k));
        let first = same.next()?;
        let design = key_of(first).3;
        same.all(|r| key_of(r).3 == design).then_some(first)
    };
    let mut joined: Vec<(Key, Option<&Json>, Option<&Json>)> = Vec::new();
    let mut used: Vec<Key> = Vec::new();
    let mut stood_in = false;
    for k in &offload_keys {
        let n = find(native, k).or_else(|| {
            let r = stand_in(k)?;
            stood_in = true;
            Some(r)
        });
        if let Some(r) = n {
            used.push(key_of(r));
        }
        joined.push((k.clone(), n, find(offload, k)));
    }
    let mut native_keys: Vec<Key> = native.iter().map(key_of).collect();
    native_keys.sort();
    native_keys.dedup();
    for k in native_keys {
        if !used.contains(&k) && !offload_keys.contains(&k) {
            let n = find(native, &k);
            joined.push((k, n, None));
        }
    }
    joined.sort_by(|a, b| a.0.cmp(&b.0));

    let late_header = [
        "coll",
        "bytes",
        "delay_ms",
        "native_tail_us",
        "offload_tail_us",
        "tail_ratio",
        "native_mean_in_call_us",
        "offload_mean_in_call_us",
        "validated",
    ];
    let overlap_header = [
        "coll",
        "bytes",
        "native_pure_us",
        "offload_pure_us",
        "pure_ratio",
        "native_overall_us",
        "offload_overall_us",
        "native_overlap_pct",
        "offload_overlap_pct",
        "native_host_us",
        "offload_host_us",
        "native_loop_us",
        "offload_loop_us",
        "validated",
    ];
    let mut header: Vec<String> = if late {
        &late_header[..]
    } else {
        &overlap_header[..]
    }
    .iter()
    .map(|h| h.to_string())
    .collect();
    // The design goes after the point's other coordinates.
    let design_at = if late { 3 } else { 2 };
    if show_design {
        header.insert(design_at, "design".into());
    }
    let mut lines: Vec<Vec<String>> = Vec::new();
    let mut ok = true;
    for (k, n, o) in &joined {
        let (n, o) = (*n, *o);
        let both_valid = validated(n) && validated(o);
        ok &= both_valid;
        let ratio_of = |f: &str| ratio(num(n, f), num(o, f));
        let valid = match (n, o) {
            (Some(_), Some(_)) => both_valid.to_string(),
            (None, _) => "no native row".into(),
            (_, None) => "no offload row".into(),
        };
        let mut l = if late {
            vec![
                k.0.clone(),
                k.1.to_string(),
                k.2.to_string(),
                cell(num(n, "tail_us"), 1),
                cell(num(o, "tail_us"), 1),
                cell(ratio_of("tail_us"), 2),
                cell(num(n, "mean_in_call_us"), 1),
                cell(num(o, "mean_in_call_us"), 1),
                valid,
            ]
        } else {
            vec![
                k.0.clone(),
                k.1.to_string(),
                cell(num(n, "pure_us"), 2),
                cell(num(o, "pure_us"), 2),
                cell(ratio_of("pure_us"), 2),
                cell(num(n, "overall_us"), 2),
                cell(num(o, "overall_us"), 2),
                cell(num(n, "overlap_pct"), 1),
                cell(num(o, "overlap_pct"), 1),
                cell(host_us(n), 1),
                cell(host_us(o), 1),
                cell(num(n, "loop_us"), 1),
                cell(num(o, "loop_us"), 1),
                valid,
            ]
        };
        if show_design {
            l.insert(design_at, k.3.clone().unwrap_or_else(|| "-".into()));
        }
        lines.push(l);
    }
    let mut legend = if late {
        "tail_us = time from the last rank's entry to the last rank's exit; tail_ratio = native \
         tail_us / offload tail_us (above 1: the offload finishes sooner after the last arrival)."
            .to_string()
    } else {
        "pure_ratio = native pure_us / offload pure_us; host_us = post_us + wait_us with compute \
         (time the host spent in MPI calls instead of computing); loop_us = wall-clock time per \
         iteration with compute, setup and barrier included."
            .to_string()
    };
    if stood_in {
        legend.push_str(
            " Where the native file lacks a design, its run of another design stands in (natively \
             the design changes nothing).",
        );
    }
    let sides = [
        ("native".to_string(), run_context(native)),
        ("offload".to_string(), run_context(offload)),
    ];
    (
        render_compare(&sides, &legend, &header, &lines, markdown),
        ok,
    )
}

/// The column-group label of an offload file: the design its rows share, else its file name.
fn offload_label(path: &Path, rows: &[Json]) -> String {
    let mut designs = rows.iter().map(|r| r["design"].as_str());
    match designs.next() {
        Some(Some(d)) if designs.all(|x| x == Some(d)) => d.to_string(),
        _ => path.file_stem().map_or_else(
            || path.display().to_string(),
            |s| s.to_string_lossy().into(),
        ),
    }
}

/// A measured point: (coll, bytes, delay_ms).
type Point = (String, u64, u64);

/// Rows by point; an error if a file has two rows for one point.
fn by_point<'a>(name: &str, rows: &'a [Json]) -> Result<Vec<(Point, &'a Json)>, String> {
    let mut out: Vec<(Point, &Json)> = Vec::new();
    for r in rows {
        let k = key_of(r);
        let p = (k.0, k.1, k.2);
        if out.iter().any(|(q, _)| *q == p) {
            return Err(format!(
                "{name} has more than one row for coll={} bytes={}{}: with several --offload \
                 files every file must hold one run per point (split it, or compare it alone)",
                p.0,
                p.1,
                if p.2 > 0 {
                    format!(" delay_ms={}", p.2)
                } else {
                    String::new()
                }
            ));
        }
        out.push((p, r));
    }
    Ok(out)
}

/// One native file and several offloaded ones, joined on (coll, bytes, delay_ms) with one
/// column group per offloaded file; returns the table and whether every row is in every file
/// and validated.
fn compare_many<'a>(
    native: &'a [Json],
    native_name: &str,
    offloads: &'a [(PathBuf, Vec<Json>)],
    markdown: bool,
) -> Result<(String, bool), String> {
    let late = is_late(native.iter().chain(offloads.iter().flat_map(|(_, r)| r)));
    let mut labels: Vec<String> = Vec::new();
    for (path, rows) in offloads {
        let base = offload_label(path, rows);
        let mut label = base.clone();
        let mut k = 2;
        while labels.contains(&label) || label == "native" {
            label = format!("{base}-{k}");
            k += 1;
        }
        labels.push(label);
    }
    let nat = by_point(native_name, native)?;
    let offs = offloads
        .iter()
        .map(|(path, rows)| by_point(&path.display().to_string(), rows))
        .collect::<Result<Vec<_>, _>>()?;
    let mut points: Vec<Point> = nat
        .iter()
        .chain(offs.iter().flatten())
        .map(|(p, _)| p.clone())
        .collect();
    points.sort();
    points.dedup();

    let mut header: Vec<String> = vec!["coll".into(), "bytes".into()];
    if late {
        header.extend(["delay_ms", "native_tail_us", "native_mean_in_call_us"].map(String::from));
    } else {
        header.extend(
            [
                "native_pure_us",
                "native_overall_us",
                "native_overlap_pct",
                "native_host_us",
                "native_loop_us",
            ]
            .map(String::from),
        );
    }
    for l in &labels {
        let cols: &[&str] = if late {
            &["tail_us", "tail_ratio", "mean_in_call_us"]
        } else {
            &[
                "pure_us",
                "pure_ratio",
                "overall_us",
                "overlap_pct",
                "host_us",
                "loop_us",
            ]
        };
        header.extend(cols.iter().map(|c| format!("{l}_{c}")));
    }
    header.push("validated".into());

    let find = |rows: &[(Point, &'a Json)], p: &Point| -> Option<&'a Json> {
        rows.iter().find(|(q, _)| q == p).map(|(_, r)| *r)
    };
    let mut lines = Vec::new();
    let mut ok = true;
    for p in &points {
        let n = find(&nat, p);
        let mut l = vec![p.0.clone(), p.1.to_string()];
        if late {
            l.extend([
                p.2.to_string(),
                cell(num(n, "tail_us"), 1),
                cell(num(n, "mean_in_call_us"), 1),
            ]);
        } else {
            l.extend([
                cell(num(n, "pure_us"), 2),
                cell(num(n, "overall_us"), 2),
                cell(num(n, "overlap_pct"), 1),
                cell(host_us(n), 1),
                cell(num(n, "loop_us"), 1),
            ]);
        }
        let mut missing = Vec::new();
        if n.is_none() {
            missing.push("no native row".to_string());
        }
        let mut all_valid = validated(n);
        for (rows, label) in offs.iter().zip(&labels) {
            let o = find(rows, p);
            if o.is_none() {
                missing.push(format!("no {label} row"));
            }
            all_valid &= validated(o);
            if late {
                l.extend([
                    cell(num(o, "tail_us"), 1),
                    cell(ratio(num(n, "tail_us"), num(o, "tail_us")), 2),
                    cell(num(o, "mean_in_call_us"), 1),
                ]);
            } else {
                l.extend([
                    cell(num(o, "pure_us"), 2),
                    cell(ratio(num(n, "pure_us"), num(o, "pure_us")), 2),
                    cell(num(o, "overall_us"), 2),
                    cell(num(o, "overlap_pct"), 1),
                    cell(host_us(o), 1),
                    cell(num(o, "loop_us"), 1),
                ]);
            }
        }
        ok &= all_valid;
        l.push(if missing.is_empty() {
            all_valid.to_string()
        } else {
            missing.join(", ")
        });
        lines.push(l);
    }
    let legend = if late {
        "tail_us = time from the last rank's entry to the last rank's exit; X_tail_ratio = native \
         tail_us / X tail_us (above 1: X finishes sooner after the last arrival)."
    } else {
        "X_pure_ratio = native pure_us / X pure_us (above 1: X is faster); host_us = post_us + \
         wait_us with compute (time the host spent in MPI calls instead of computing); loop_us = \
         wall-clock time per iteration with compute, setup and barrier included."
    };
    let mut sides = vec![("native".to_string(), run_context(native))];
    for ((_, rows), label) in offloads.iter().zip(&labels) {
        sides.push((label.clone(), run_context(rows)));
    }
    Ok((
        render_compare(&sides, legend, &header, &lines, markdown),
        ok,
    ))
}

pub fn compare(args: CompareArgs) -> i32 {
    let native = match read_rows(&args.native) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("coll-bench compare: {e}");
            return 2;
        }
    };
    let mut offloads = Vec::new();
    for path in &args.offload {
        match read_rows(path) {
            Ok(r) => offloads.push((path.clone(), r)),
            Err(e) => {
                eprintln!("coll-bench compare: {e}");
                return 2;
            }
        }
    }
    let result = match offloads.as_slice() {
        [(_, offload)] => Ok(compare_one(&native, offload, args.markdown)),
        _ => compare_many(
            &native,
            &args.native.display().to_string(),
            &offloads,
            args.markdown,
        ),
    };
    let (text, ok) = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("coll-bench compare: {e}");
            return 2;
        }
    };
    print!("{text}");
    let _ = std::io::stdout().flush();
    if !ok {
        eprintln!("coll-bench compare: some sizes did not validate or are missing on one side");
        return 1;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(coll: &str, bytes: u64, design: Option<&str>, pure_us: f64, mode: &str) -> Json {
        serde_json::json!({
            "coll": coll, "bytes": bytes, "ranks": 4, "nodes": 2, "mode": mode,
            "pure_us": pure_us, "overall_us": 2.0 * pure_us, "compute_us": pure_us,
            "post_us": 0.5, "wait_us": 1.5, "loop_us": 3.0 * pure_us, "overlap_pct": 50.0,
            "validated": true,
            "design": design,
        })
    }

    #[test]
    fn compare_without_designs_keeps_the_old_table() {
        let native = [row("ialltoallv", 1024, None, 10.0, "native")];
        let offload = [row("ialltoallv", 1024, None, 5.0, "offload")];
        let (text, ok) = compare_one(&native, &offload, false);
        assert!(ok);
        let expected = "\
# native: ranks=4 nodes=2 mode=native; offload: ranks=4 nodes=2 mode=offload; pure_ratio = native pure_us / offload pure_us; host_us = post_us + wait_us with compute (time the host spent in MPI calls instead of computing); loop_us = wall-clock time per iteration with compute, setup and barrier included.
      coll bytes native_pure_us offload_pure_us pure_ratio native_overall_us offload_overall_us native_overlap_pct offload_overlap_pct native_host_us offload_host_us native_loop_us offload_loop_us validated
ialltoallv  1024          10.00            5.00       2.00             20.00              10.00               50.0                50.0            2.0             2.0           30.0            15.0      true
";
        assert_eq!(text, expected);
        let (md, _) = compare_one(&native, &offload, true);
        assert!(md.starts_with("Native: ranks=4 nodes=2 mode=native; offload: ranks=4"));
        assert!(md.contains("\n| coll | bytes | native_pure_us |"));
        assert!(!md.contains("design"));
    }

    #[test]
    fn compare_joins_on_design() {
        // Native runs of both designs: each offload row meets its own.
        let native = [
            row("ibcast", 1024, Some("flat"), 10.0, "native"),
            row("ibcast", 1024, Some("hier"), 20.0, "native"),
        ];
        let offload = [
            row("ibcast", 1024, Some("hier"), 10.0, "offload"),
            row("ibcast", 1024, Some("flat"), 5.0, "offload"),
        ];
        let (text, ok) = compare_one(&native, &offload, false);
        assert!(ok, "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].contains(" design "), "{text}");
        assert_eq!(lines.len(), 4, "{text}");
        // flat: 10 / 5, hier: 20 / 10: both ratios 2.00, sorted by design.
        let cols = |l: &str| l.split_whitespace().map(String::from).collect::<Vec<_>>();
        assert_eq!(
            cols(lines[2])[..6],
            ["ibcast", "1024", "flat", "10.00", "5.00", "2.00"]
        );
        assert_eq!(
            cols(lines[3])[..6],
            ["ibcast", "1024", "hier", "20.00", "10.00", "2.00"]
        );
        assert!(!text.contains("stands in"));

        // One native run (design auto) serves both offload designs.
        let native = [row("ibcast", 1024, Some("auto"), 10.0, "native")];
        let (text, ok) = compare_one(&native, &offload, false);
        assert!(ok, "{text}");
        assert!(text.contains("stands in"), "{text}");
        assert_eq!(text.lines().count(), 4, "{text}");
        assert!(!text.contains("no offload row") && !text.contains("no native row"));

        // Native rows of two other designs: no stand-in, every row is missing a side.
        let native = [
            row("ibcast", 1024, Some("auto"), 10.0, "native"),
            row("ibcast", 1024, Some("lb"), 10.0, "native"),
        ];
        let (text, ok) = compare_one(&native, &offload, true);
        assert!(!ok);
        assert_eq!(text.matches("no native row").count(), 2, "{text}");
        assert_eq!(text.matches("no offload row").count(), 2, "{text}");
    }

    #[test]
    fn compare_many_puts_designs_side_by_side() {
        let native = vec![
            row("ibcast", 0, Some("auto"), 1.0, "native"),
            row("ibcast", 1024, Some("auto"), 10.0, "native"),
        ];
        let flat = vec![
            row("ibcast", 0, Some("flat"), 1.0, "offload"),
            row("ibcast", 1024, Some("flat"), 5.0, "offload"),
        ];
        let hier = vec![row("ibcast", 1024, Some("hier"), 4.0, "offload")];
        let files = vec![
            (PathBuf::from("x/flat-run.json"), flat.clone()),
            (PathBuf::from("x/hier-run.json"), hier),
        ];
        let (text, ok) = compare_many(&native, "n.json", &files, false).unwrap();
        assert!(!ok, "the hier file lacks size 0");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("# native: ranks=4 nodes=2 mode=native; flat: "));
        assert!(lines[0].contains("; hier: ranks=4"));
        let header: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            header[2..7],
            [
                "native_pure_us",
                "native_overall_us",
                "native_overlap_pct",
                "native_host_us",
                "native_loop_us"
            ]
        );
        assert_eq!(header[7..9], ["flat_pure_us", "flat_pure_ratio"]);
        assert_eq!(header[12], "flat_loop_us");
        assert_eq!(header[13..15], ["hier_pure_us", "hier_pure_ratio"]);
        assert_eq!(*header.last().unwrap(), "validated");
        assert!(lines[2].ends_with("no hier row"), "{text}");
        let last: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(last[6], "30.0");
        assert_eq!(last[7..9], ["5.00", "2.00"]);
        assert_eq!(last[12], "15.0");
        assert_eq!(last[13..15], ["4.00", "2.50"]);
        assert_eq!(*last.last().unwrap(), "true");

        // Rows without one design are labelled by file name; equal labels get a suffix.
        let mixed = vec![row("ibcast", 0, None, 1.0, "offload")];
        assert_eq!(offload_label(Path::new("d/run1.json"), &mixed), "run1");
        let files = vec![
            (PathBuf::from("a.json"), flat.clone()),
            (PathBuf::from("b.json"), flat.clone()),
        ];
        let (text, _) = compare_many(&native, "n.json", &files, true).unwrap();
        assert!(text.contains("| flat_pure_us |") && text.contains("| flat-2_pure_us |"));

        // Two runs of one point in a file cannot be one column group.
        let mut both = flat.clone();
        both.push(row("ibcast", 0, Some("hier"), 1.0, "offload"));
        let files = vec![
            (PathBuf::from("both.json"), both),
            (PathBuf::from("f.json"), flat),
        ];
        let e = compare_many(&native, "n.json", &files, false).unwrap_err();
        assert!(
            e.contains("both.json has more than one row for coll=ibcast bytes=0"),
            "{e}"
        );
    }
}
