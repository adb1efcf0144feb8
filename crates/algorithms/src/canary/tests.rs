//! Hosts and one switch in memory (a star): results against a reference computed here,
//! with collisions, loss and duplicates.

use std::collections::{HashMap, VecDeque};

use super::*;
use crate::allreduce::{reduce_into, Elem, Op, Reduce};
use crate::sim::rng::Rng;

const SUM: Reduce = Reduce {
    op: Op::Sum,
    elem: Elem::I32,
};

struct Star {
    sw: Switch,
    hosts: Vec<Host>,
    inputs: Vec<Vec<u8>>,
    results: Vec<Vec<u8>>,
    done: Vec<Option<Result<(), HostError>>>,
}

fn star(n: usize, slots: usize, len: usize, seed: u64, tweak: impl Fn(&mut HostConfig)) -> Star {
    let mut rng = Rng::new(seed);
    let members: Vec<Addr> = (0..n as Addr).collect();
    let sw = Switch::new(SwitchConfig {
        addr: 1000,
        slots,
        timeout: 500,
        hold: 50_000,
        up_ports: vec![],
        down: members.iter().map(|&m| (m, m as Port)).collect(),
        trees: HashMap::new(),
    });
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|_| (0..len).map(|_| rng.next_u64() as u8).collect())
        .collect();
    let hosts = (0..n)
        .map(|me| {
            let mut cfg = HostConfig {
                coll: 5,
                tag: 0xfeed,
                reduce: SUM,
                members: members.clone(),
                me,
                len,
                block_bytes: 64,
                window: 8,
                static_trees: None,
                retx_timeout: 20_000,
                max_requests: 16,
                retx_backoff: 0,
                restart_holdoff: 10_000,
                max_attempts: 8,
                wait_for_late: false,
            };
            tweak(&mut cfg);
            Host::new(cfg)
        })
        .collect();
    Star {
        sw,
        hosts,
        inputs,
        results: vec![vec![0; len]; n],
        done: vec![None; n],
    }
}

fn reference(inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        reduce_into(SUM, &mut acc, x).unwrap();
    }
    acc
}

/// Runs the star: every hop takes 100 ns; `drop` decides per (hop number, packet) whether
/// the packet is lost. Returns the virtual end time.
fn run(s: &mut Star, drop: impl FnMut(u64, &Packet) -> bool) -> u64 {
    run_late(s, None, drop)
}

/// [`run`] with host `late.0` starting only at time `late.1`; until then packets to it are
/// kept and fed to it when it starts, and a retransmission request is answered with `Wait`
/// as an SP's data path answers one for an allreduce it has not started.
fn run_late(
    s: &mut Star,
    late: Option<(usize, u64)>,
    mut drop: impl FnMut(u64, &Packet) -> bool,
) -> u64 {
    let n = s.hosts.len();
    let mut kept: Vec<Packet> = Vec::new();
    let mut late = late;
    let loads = vec![
        PortLoad {
            queued: 0,
            capacity: 1 << 20,
            up: true
        };
        n
    ];
    // (time, to switch?, port/host, packet)
    let mut q: VecDeque<(u64, bool, usize, Packet)> = VecDeque::new();
    let mut now = 0;
    for h in 0..n {
        if late.is_some_and(|(l, _)| l == h) {
            continue;
        }
        for p in s.hosts[h].start(0, &s.inputs[h]) {
            q.push_back((100, true, h, p));
        }
    }
    let mut hop = 0u64;
    loop {
        for h in 0..n {
            while let Some(e) = s.hosts[h].poll_event() {
                match e {
                    HostEvent::Block { offset, data, .. } => {
                        s.results[h][offset..offset + data.len()].copy_from_slice(&data)
                    }
                    HostEvent::Done => s.done[h] = Some(Ok(())),
                    HostEvent::Failed(e) => s.done[h] = Some(Err(e)),
                }
            }
        }
        if let Some((l, at)) = late {
            if now >= at {
                late = None;
                let input = s.inputs[l].clone();
                let mut out = s.hosts[l].start(now, &input);
                for p in std::mem::take(&mut kept) {
                    out.extend(s.hosts[l].on_packet(now, p, &input));
                }
                for p in out {
                    q.push_back((now + 100, true, l, p));
                }
            }
        }
        if s.done.iter().all(|d| d.is_some()) && q.is_empty() {
            break;
        }
        // next event: a queued packet or a timer
        let tq = q.iter().map(|e| e.0).min();
        let tt = s
            .hosts
            .iter()
            .filter_map(|h| h.next_deadline())
            .chain(s.sw.next_deadline())
            .min();
        let tt = match (tt, late) {
            (Some(t), Some((_, at))) => Some(t.min(at)),
            (None, Some((_, at))) => Some(at),
            (t, None) => t,
        };
        let t = match (tq, tt) {
            (None, None) => break,
            (a, b) => a.unwrap_or(u64::MAX).min(b.unwrap_or(u64::MAX)),
        };
        assert!(t < 100_000_000, "no progress");
        now = t;
        if let Some(i) = q.iter().position(|e| e.0 == t) {
            let (_, to_switch, at, p) = q.remove(i).unwrap();
            hop += 1;
            if drop(hop, &p) {
                if std::env::var("CANARY_TRACE").is_ok() {
                    eprintln!("{now} DROP {to_switch} {at} {p:?}");
                }
                continue;
            }
            if std::env::var("CANARY_TRACE").is_ok() {
                eprintln!("{now} {to_switch} {at} {p:?}");
            }
            if to_switch {
                for (port, p) in s.sw.on_packet(now, at as Port, p, &loads) {
                    q.push_back((now + 100, false, port as usize, p));
                }
            } else if late.is_some_and(|(l, _)| l == at) {
                if let Packet::Retx { head, host } = &p {
                    let wait = Packet::Wait {
                        head: Head {
                            dst: *host,
                            ..*head
                        },
                    };
                    q.push_back((now + 100, true, at, wait));
                }
                kept.push(p);
            } else {
                let out = s.hosts[at].on_packet(now, p, &s.inputs[at]);
                for p in out {
                    q.push_back((now + 100, true, at, p));
                }
            }
        } else {
            for (port, p) in s.sw.on_timer(now, &loads) {
                q.push_back((now + 100, false, port as usize, p));
            }
            for h in 0..n {
                if late.is_some_and(|(l, _)| l == h) {
                    continue;
                }
                if s.hosts[h].next_deadline().is_some_and(|d| d <= now) {
                    for p in s.hosts[h].on_timer(now, &s.inputs[h]) {
                        q.push_back((now + 100, true, h, p));
                    }
                }
            }
        }
    }
    now
}

fn check_ok(s: &Star) {
    let r = reference(&s.inputs);
    for h in 0..s.hosts.len() {
        assert_eq!(s.done[h], Some(Ok(())), "host {h}");
        assert_eq!(s.results[h], r, "host {h}");
    }
}

#[test]
fn star_reduces_byte_exact() {
    let seed = 11;
    println!("seed {seed}");
    for n in [1, 2, 5, 9] {
        let mut s = star(n, 64, 1000, seed + n as u64, |_| {});
        run(&mut s, |_, _| false);
        check_ok(&s);
        assert_eq!(s.hosts.iter().map(|h| h.stats().restarts).sum::<u64>(), 0);
    }
}

/// A host says `Done` once: packets of its allreduce that come after (a late copy, another
/// member's retransmission) are ignored or answered, never reported as a second completion.
#[test]
fn a_host_reports_done_once_whatever_comes_after() {
    let seed = 17;
    println!("seed {seed}");
    let mut s = star(3, 64, 1000, seed, |_| {});
    run(&mut s, |_, _| false);
    check_ok(&s);
    // The same members' packets once more (a fresh star of the same configuration).
    let mut again = star(3, 64, 1000, seed, |_| {});
    for m in 1..3 {
        let input = again.inputs[m].clone();
        for p in again.hosts[m].start(0, &input) {
            let input0 = s.inputs[0].clone();
            let _ = s.hosts[0].on_packet(1_000_000, p, &input0);
        }
    }
    let input0 = s.inputs[0].clone();
    let _ = s.hosts[0].on_timer(2_000_000, &input0);
    let events: Vec<_> = std::iter::from_fn(|| s.hosts[0].poll_event()).collect();
    assert!(
        !events.iter().any(|e| matches!(e, HostEvent::Done)),
        "a second Done: {events:?}"
    );
}

#[test]
fn star_with_a_one_slot_table_restores_collided_children() {
    let seed = 12;
    println!("seed {seed}");
    let mut s = star(6, 1, 2000, seed, |_| {});
    run(&mut s, |_, _| false);
    check_ok(&s);
    assert!(s.sw.stats().collisions > 0);
    assert!(s.sw.stats().restores > 0);
}

#[test]
fn star_recovers_from_random_loss() {
    for seed in 20..26 {
        println!("seed {seed}");
        let mut rng = Rng::new(seed);
        let mut s = star(5, 16, 1500, seed, |_| {});
        run(&mut s, |_, _| rng.chance(1, 20));
        check_ok(&s);
    }
}

#[test]
fn star_losing_everything_ends_in_an_error_on_every_host() {
    let mut s = star(4, 16, 256, 30, |c| c.max_attempts = 3);
    let end = run(&mut s, |hop, p| {
        hop > 10
            && !matches!(
                p,
                Packet::Abort { .. } | Packet::Retx { .. } | Packet::Restart { .. }
            )
    });
    for h in 0..4 {
        assert!(
            matches!(s.done[h], Some(Err(_))),
            "host {h}: {:?}",
            s.done[h]
        );
    }
    assert!(end < 10_000_000);
    // and when nothing at all gets through: the leaders are unreachable
    let mut s = star(4, 16, 256, 31, |_| {});
    run(&mut s, |_, _| true);
    for h in 0..4 {
        assert!(
            matches!(s.done[h], Some(Err(_)) | Some(Ok(()))),
            "host {h}: {:?}",
            s.done[h]
        );
    }
    assert!(s
        .done
        .iter()
        .any(|d| matches!(d, Some(Err(HostError::LeaderUnreachable { .. })))));
}

/// A member that starts long after the others (50 times the bound on unanswered requests,
/// `max_requests * retx_timeout`), with `wait_for_late`: the late member's stand-in answers
/// requests with `Wait`, the leaders answer with `Wait` between backed-off restarts, and every
/// host ends with the right result. The same without `wait_for_late` (the paper's hosts, the
/// requests unanswered by the late member's stand-in being ignored by them): some host fails.
#[test]
fn a_late_member_is_waited_for_only_with_wait_for_late() {
    for seed in 40..44 {
        println!("seed {seed}");
        let late_by = 50 * 16 * 20_000;
        let mut s = star(5, 64, 1500, seed, |c| {
            c.wait_for_late = true;
            c.max_attempts = 1000;
        });
        run_late(&mut s, Some((4, late_by)), |_, _| false);
        check_ok(&s);
        let waited: u64 = s.hosts.iter().map(|h| h.stats().retx_requests).sum();
        assert!(waited > 0, "nobody asked while the member was late");

        let mut s = star(5, 64, 1500, seed, |_| {});
        run_late(&mut s, Some((4, late_by)), |_, _| false);
        assert!(
            s.done.iter().any(|d| matches!(d, Some(Err(_)))),
            "the paper's hosts waited: {:?}",
            s.done
        );
    }
}

/// A silent leader: with `retx_backoff: 0` a member asks again every `retx_timeout` and gives
/// up after `max_requests` (the paper's behaviour); with `retx_backoff: 3` the waits double
/// up to 8 x and the member gives up later, after as many requests.
#[test]
fn unanswered_requests_back_off_only_when_asked() {
    for (backoff, want) in [(0u32, vec![1u64; 6]), (3, vec![1, 2, 4, 8, 8, 8])] {
        let t = 20_000;
        let cfg = HostConfig {
            coll: 9,
            tag: 1,
            reduce: SUM,
            members: vec![1, 2],
            me: 0,
            // Two blocks: block 0 is ours to lead, block 1 member 2's, who never answers.
            len: 128,
            block_bytes: 64,
            window: 8,
            static_trees: None,
            retx_timeout: t,
            max_requests: 5,
            retx_backoff: backoff,
            restart_holdoff: 10_000,
            max_attempts: 8,
            wait_for_late: false,
        };
        assert_eq!(cfg.leader_of(1), 1);
        let input = vec![7u8; 128];
        let mut h = Host::new(cfg);
        let sent = h.start(0, &input);
        assert!(sent.iter().any(|p| matches!(p, Packet::Reduce { .. })));
        let (mut now, mut gaps, mut requests) = (0, vec![], 0);
        while let Some(d) = h.next_deadline() {
            gaps.push((d - now) / t);
            now = d;
            requests += h
                .on_timer(now, &input)
                .iter()
                .filter(|p| matches!(p, Packet::Retx { .. }))
                .count();
            if h.finished() {
                break;
            }
        }
        assert_eq!(gaps, want, "backoff {backoff}");
        assert_eq!(requests, 5, "backoff {backoff}");
        let ev: Vec<_> = std::iter::from_fn(|| h.poll_event()).collect();
        assert!(
            ev.iter().any(|e| matches!(
                e,
                HostEvent::Failed(HostError::LeaderUnreachable { block: 1 })
            )),
            "backoff {backoff}: {ev:?}"
        );
    }
}
