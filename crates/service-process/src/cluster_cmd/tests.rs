use super::*;

fn opts(hosts: &[&str], k: u32) -> Init {
    let map = hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            (
                h.to_string(),
                (format!("10.0.0.{}", i + 1), format!("10.1.0.{}", i + 1)),
            )
        })
        .collect();
    Init {
        hosts: hosts.iter().map(|h| h.to_string()).collect(),
        sps_per_node: k,
        dpus: Dpus::Map(map),
        peer_port: 7100,
        host_port: 7200,
        socket_dir: "/run/spoff".into(),
    }
}

fn generated(hosts: &[&str], k: u32) -> String {
    serde_json::to_string_pretty(&init(&opts(hosts, k)).unwrap()).unwrap()
}

fn problems(text: &str) -> Vec<String> {
    check_text(text).map(|_| ()).unwrap_err()
}

#[test]
fn init_gives_each_node_its_host_dpu_addresses_and_k_sps() {
    let c = init(&opts(&["node01", "node02", "gpu7"], 2)).unwrap();
    assert_eq!(c.nodes, 3);
    assert_eq!(c.hosts, ["node01", "node02", "gpu7"]);
    assert_eq!(c.sps.len(), 6);
    let sp = &c.sps[3]; // node 1, index 1
    assert_eq!((sp.node, sp.index), (1, 1));
    assert_eq!(sp.peer_addr, "10.1.0.2:7101".parse().unwrap());
    assert_eq!(sp.host_addr, Some("10.0.0.2:7201".parse().unwrap()));
    assert_eq!(sp.host_socket, Path::new("/run/spoff/3/host.sock"));
    // What init writes, check accepts.
    let text = generated(&["node01", "node02", "gpu7"], 2);
    assert_eq!(check_text(&text).unwrap(), c);
    assert!(summary(Path::new("c.json"), &c).contains("node 2 host gpu7"));
}

#[test]
fn init_refuses_duplicates_overlapping_ports_and_unmapped_hosts() {
    let e = init(&opts(&["a", "b", "a"], 1)).unwrap_err().to_string();
    assert!(e.contains("given twice"), "{e}");
    let mut o = opts(&["a"], 4);
    o.host_port = 7102;
    let e = init(&o).unwrap_err().to_string();
    assert!(e.contains("overlap"), "{e}");
    let mut o = opts(&["a", "b"], 1);
    if let Dpus::Map(m) = &mut o.dpus {
        m.remove("b");
    }
    let e = init(&o).unwrap_err().to_string();
    assert!(e.contains("no line for host \"b\""), "{e}");
    let mut o = opts(&["a"], 1);
    o.dpus = Dpus::Suffix(".invalid-spoff-test.".into());
    assert!(init(&o).is_err());
    let mut o = opts(&["a"], 3);
    o.peer_port = 65534;
    assert!(init(&o).unwrap_err().to_string().contains("65535"));
}

#[test]
fn init_resolves_a_dpu_suffix() {
    // "localhost" + "" resolves everywhere.
    let mut o = opts(&["localhost"], 1);
    o.dpus = Dpus::Suffix(String::new());
    let c = init(&o).unwrap();
    assert!(c.sps[0].peer_addr.ip().is_loopback());
    assert!(
        c.dpus.is_empty(),
        "an empty suffix names no DPU: {:?}",
        c.dpus
    );
}

#[test]
fn init_names_the_dpus_where_they_have_names() {
    // A map of addresses names no DPU; a map of names does (serve --sp-id auto uses them).
    assert!(init(&opts(&["a", "b"], 1)).unwrap().dpus.is_empty());
    let mut o = opts(&["a"], 1);
    o.dpus = Dpus::Map(
        [(
            "a".to_string(),
            ("localhost".to_string(), "localhost".to_string()),
        )]
        .into_iter()
        .collect(),
    );
    let c = init(&o).unwrap();
    assert_eq!(c.dpus, ["localhost"]);
    assert!(summary(Path::new("c.json"), &c).contains("node 0 host a dpu localhost"));
    // check refuses a DPU name that is also a host name, naming both fields.
    let mut v = serde_json::to_value(&c).unwrap();
    v["dpus"] = serde_json::json!(["a"]);
    let p = problems(&serde_json::to_string_pretty(&v).unwrap());
    assert!(
        p.iter()
            .any(|m| m.contains("dpus[0]: \"a\" is also hosts[0]")),
        "{p:?}"
    );
}

#[test]
fn check_reports_json_errors_with_line_and_column() {
    let text = generated(&["a", "b"], 1);
    // Cut the text on line 3: a syntax error there.
    let broken: String = text.lines().take(3).collect::<Vec<_>>().join("\n") + "\n,";
    let p = problems(&broken);
    assert!(p[0].starts_with("line 4 column"), "{p:?}");
    assert!(
        !p[0].contains(" at line"),
        "the position is said once: {p:?}"
    );
    // A wrong type names its line.
    let bad = text.replacen("\"sps_per_node\": 1", "\"sps_per_node\": \"one\"", 1);
    let p = problems(&bad);
    let line = bad.lines().position(|l| l.contains("\"one\"")).unwrap() + 1;
    assert!(
        p[0].starts_with(&format!("sps_per_node: line {line} ")),
        "{p:?}"
    );
    // A bad address too, and a port out of range: each names its field (issue 25).
    let bad = text.replacen("10.1.0.2:7100", "10.1.0.2:port", 1);
    assert!(problems(&bad)[0].contains("line"), "{:?}", problems(&bad));
    let bad = text.replacen("10.1.0.2:7100", "10.1.0.2:71000", 1);
    let p = problems(&bad);
    assert!(p[0].starts_with("sps[1].peer_addr: line "), "{p:?}");
    // A missing field names the SP it is missing from.
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["sps"][1].as_object_mut().unwrap().remove("peer_addr");
    let p = problems(&serde_json::to_string_pretty(&v).unwrap());
    assert!(
        p[0].starts_with("sps[1]: ") && p[0].contains("missing field `peer_addr`"),
        "{p:?}"
    );
}

#[test]
fn check_names_every_bad_field() {
    let good = generated(&["a", "b"], 2);
    let assert_problems_after = |edit: &dyn Fn(&mut serde_json::Value), said: &[&str]| {
        let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
        edit(&mut v);
        let p = problems(&v.to_string());
        for s in said {
            assert!(p.iter().any(|x| x.contains(s)), "{s:?} not in {p:#?}");
        }
    };
    assert_problems_after(
        &|v| {
            v["sps"][1]["peer_addr"] = v["sps"][0]["peer_addr"].clone();
            v["sps"][2]["host_addr"] = v["sps"][3]["host_addr"].clone();
            v["sps"][3]["host_socket"] = "relative.sock".into();
            v["hosts"][1] = "a".into();
            v["colour"] = "blue".into();
        },
        &[
            "sps[1].peer_addr: 10.1.0.1:7100 is also sps[0].peer_addr",
            "sps[3].host_addr: 10.0.0.2:7201 is also sps[2].host_addr",
            "sps[3].host_socket: relative.sock is not an absolute path",
            "hosts[1]: \"a\" is also hosts[0]",
            "colour: unknown field",
        ],
    );
    assert_problems_after(
        &|v| {
            v["sps"][1]["id"] = 5.into();
            v["sps"][2]["index"] = 7.into();
            v["sps"][3]["peer_addr"] = "0.0.0.0:0".into();
            v["sps"][0]["host_socket"] = v["sps"][1]["host_socket"].clone();
            v["sps"][0]["porrt"] = 1.into();
        },
        &[
            "sps[1].id: 5",
            "sps[2].index: 7 outside the 2 SPs of a node",
            "sps[3].peer_addr: 0.0.0.0:0 has port 0",
            "is not an address one can connect to",
            "sps[1].host_socket: /run/spoff/1/host.sock is also sps[0].host_socket",
            "sps[0].porrt: unknown field",
        ],
    );
    assert_problems_after(
        &|v| {
            v["sps_per_node"] = 0.into();
            v["hosts"] = serde_json::json!(["a"]);
        },
        &[
            "sps_per_node: must be at least 1",
            "sps: 4 entries, but nodes x sps_per_node = 2 x 0 = 0",
            "hosts: 1 names for 2 nodes",
        ],
    );

    let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
    v["sps"].as_array_mut().unwrap().pop();
    let p = problems(&v.to_string());
    assert!(p[0].contains("3 entries"), "{p:?}");
}

#[test]
fn an_emulated_description_from_launch_checks_clean() {
    let spec = crate::launch::SpSetSpec {
        nodes: 2,
        sps_per_node: 2,
        ranks_per_node: 2,
        layout: Layout::Cyclic,
        sp_cpus: None,
        max_inflight_reads: 1,
        extra_args: vec![],
        sp_args: vec![],
    };
    let dir = crate::launch::new_run_dir().unwrap();
    let (path, _l) = crate::launch::write_cluster(&spec, &dir).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let c = check_text(&text).unwrap();
    assert!(summary(&path, &c).contains("no host names"));
}

#[test]
fn host_files_and_dpu_maps() {
    let hosts =
        parse_hosts("# the cluster\nnode01 slots=4\n\nnode[02-03] slots=2 # two\ngpu7\n").unwrap();
    assert_eq!(hosts, ["node01", "node02", "node03", "gpu7"]);
    let e = parse_hosts("a\nb\nn[1-2]\nn2\n").unwrap_err();
    assert!(e.contains("line 4") && e.contains("line 3"), "{e}");
    assert!(parse_hosts("n[1-\n").unwrap_err().starts_with("line 1"));
    assert!(parse_hosts("# nothing\n").is_err());
    let m = parse_dpu_map("a 10.0.0.1\nb b-dpu 192.168.0.2 # fabric\n").unwrap();
    assert_eq!(m["a"], ("10.0.0.1".to_string(), "10.0.0.1".to_string()));
    assert_eq!(m["b"].1, "192.168.0.2");
    assert!(parse_dpu_map("a 1 2 3\n").unwrap_err().contains("line 1"));
    assert!(parse_dpu_map("a 1\na 2\n").unwrap_err().contains("twice"));
}

/// Issue 25: a description that names DPUs but not the hosts passed the check, and a multi-host
/// job then placed its ranks by layout. The check now says what is missing.
#[test]
fn check_wants_the_hosts_when_the_dpus_are_named() {
    let good = generated(&["a", "b"], 1);
    assert!(check_text(&good).is_ok());
    let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
    v["dpus"] = serde_json::json!(["a-bf", "b-bf"]);
    let with_both = serde_json::to_string_pretty(&v).unwrap();
    assert!(
        check_text(&with_both).is_ok(),
        "{:?}",
        check_text(&with_both).err()
    );
    v.as_object_mut().unwrap().remove("hosts");
    let p = problems(&serde_json::to_string_pretty(&v).unwrap());
    assert!(
        p.iter()
            .any(|l| l.starts_with("hosts: missing, but dpus names 2 DPUs")),
        "{p:?}"
    );
}
