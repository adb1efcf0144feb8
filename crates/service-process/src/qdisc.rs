//! The root qdisc of each network device, read by rtnetlink (`RTM_GETQDISC` dump, the request
//! `tc -s qdisc show` makes): its backlog in bytes (every sender's packets waiting in it) and,
//! for a token bucket (`tbf`), its limit in bytes. A Canary switch adds the backlog to a port's
//! load (`canary_switch`, `--qdisc-load`): its own socket's send queue (`SIOCOUTQ`) does not
//! count another sender's packets in the qdisc, so without it a link loaded by background
//! traffic looks idle to the switch.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

const RTM_GETQDISC: u16 = 38;
const RTM_NEWQDISC: u16 = 36;
const NLMSG_DONE: u16 = 3;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const TC_H_ROOT: u32 = 0xFFFF_FFFF;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_STATS2: u16 = 7;
const TCA_STATS_QUEUE: u16 = 3;
const TCA_TBF_PARMS: u16 = 1;
/// `struct nlmsghdr` and `struct tcmsg`.
const NLMSG_HDR: usize = 16;
const TCMSG: usize = 20;

/// One device's root qdisc.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Qdisc {
    pub kind: String,
    /// Bytes waiting in it.
    pub backlog: u64,
    /// Its limit in bytes, when it has one (`tbf`).
    pub limit: Option<u64>,
}

/// A netlink socket that dumps the root qdiscs of this network namespace.
pub struct QdiscReader {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The attributes (`struct rtattr`: length, type, value) in `b`, as (type, value).
fn attrs(b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= b.len() {
        let (Some(len), Some(ty)) = (u16_at(b, at), u16_at(b, at + 2)) else {
            break;
        };
        let len = len as usize;
        if len < 4 || at + len > b.len() {
            break;
        }
        out.push((ty & 0x3fff, &b[at + 4..at + len]));
        at += align4(len);
    }
    out
}

/// One `RTM_NEWQDISC` message's body (after the netlink header): the device and, for a root
/// qdisc, what it holds.
pub fn parse_qdisc(body: &[u8]) -> Option<(i32, Qdisc)> {
    let ifindex = u32_at(body, 4)? as i32;
    let parent = u32_at(body, 12)?;
    if parent != TC_H_ROOT {
        return None;
    }
    let mut q = Qdisc::default();
    for (ty, v) in attrs(body.get(TCMSG..)?) {
        match ty {
            TCA_KIND => {
                q.kind = String::from_utf8_lossy(v)
                    .trim_end_matches('\0')
                    .to_string()
            }
            TCA_STATS2 => {
                for (t, s) in attrs(v) {
                    // struct gnet_stats_queue { qlen, backlog, drops, requeues, overlimits }
                    if t == TCA_STATS_QUEUE {
                        q.backlog = u64::from(u32_at(s, 4).unwrap_or(0));
                    }
                }
            }
            TCA_OPTIONS => {
                for (t, o) in attrs(v) {
                    // struct tc_tbf_qopt { rate, peakrate (12 bytes each), limit, buffer, mtu }
                    if t == TCA_TBF_PARMS {
                        q.limit = u32_at(o, 24).map(u64::from);
                    }
                }
            }
            _ => {}
        }
    }
    if q.kind != "tbf" {
        q.limit = None;
    }
    Some((ifindex, q))
}

impl QdiscReader {
    pub fn new() -> io::Result<QdiscReader> {
        use nix::sys::socket::{
            setsockopt, socket, sockopt, AddressFamily, SockFlag, SockProtocol, SockType,
        };
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkRoute,
        )?;
        // A dump that never ends must not hold the switch's loop: a read gives up after this.
        setsockopt(
            &fd,
            sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(0, 50_000),
        )?;
        Ok(QdiscReader {
            fd,
            seq: 0,
            buf: vec![0; 1 << 16],
        })
    }

    /// The root qdisc of every device that has one, by interface index.
    pub fn read(&mut self) -> io::Result<HashMap<i32, Qdisc>> {
        self.seq = self.seq.wrapping_add(1);
        let mut req = [0u8; NLMSG_HDR + TCMSG];
        req[0..4].copy_from_slice(&((NLMSG_HDR + TCMSG) as u32).to_ne_bytes());
        req[4..6].copy_from_slice(&RTM_GETQDISC.to_ne_bytes());
        req[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
        req[8..12].copy_from_slice(&self.seq.to_ne_bytes());
        req[NLMSG_HDR] = libc::AF_UNSPEC as u8;
        // To the kernel (port 0).
        nix::sys::socket::sendto(
            self.fd.as_raw_fd(),
            &req,
            &nix::sys::socket::NetlinkAddr::new(0, 0),
            nix::sys::socket::MsgFlags::empty(),
        )?;
        let mut out = HashMap::new();
        loop {
            let n = nix::sys::socket::recv(
                self.fd.as_raw_fd(),
                &mut self.buf,
                nix::sys::socket::MsgFlags::empty(),
            )?;
            let b = &self.buf[..n];
            let mut at = 0;
            while at + NLMSG_HDR <= b.len() {
                let len = u32_at(b, at).unwrap_or(0) as usize;
                let ty = u16_at(b, at + 4).unwrap_or(0);
                let seq = u32_at(b, at + 8).unwrap_or(0);
                if len < NLMSG_HDR || at + len > b.len() {
                    return Err(io::Error::other("a truncated netlink message"));
                }
                if seq == self.seq {
                    match ty {
                        NLMSG_DONE => return Ok(out),
                        NLMSG_ERROR => {
                            let e = u32_at(b, at + NLMSG_HDR).unwrap_or(0) as i32;
                            return Err(io::Error::from_raw_os_error(-e));
                        }
                        RTM_NEWQDISC => {
                            if let Some((i, q)) = parse_qdisc(&b[at + NLMSG_HDR..at + len]) {
                                out.insert(i, q);
                            }
                        }
                        _ => {}
                    }
                }
                at += align4(len);
            }
        }
    }
}

/// The interface index of the device that has address `ip`, if any.
pub fn ifindex_of(ip: std::net::IpAddr) -> Option<i32> {
    let addrs = nix::ifaddrs::getifaddrs().ok()?;
    for a in addrs {
        let matches = a.address.as_ref().is_some_and(|s| {
            s.as_sockaddr_in()
                .is_some_and(|v4| std::net::IpAddr::V4(v4.ip()) == ip)
                || s.as_sockaddr_in6()
                    .is_some_and(|v6| std::net::IpAddr::V6(v6.ip()) == ip)
        });
        if matches {
            let i = nix::net::if_::if_nametoindex(a.interface_name.as_str()).ok()?;
            return i32::try_from(i).ok().filter(|&i| i > 0);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loopback device is there with a root qdisc (noqueue) on any Linux machine: the dump
    /// parses and names it.
    #[test]
    fn the_dump_parses_and_finds_loopback() {
        let lo = ifindex_of("127.0.0.1".parse().unwrap()).expect("lo's index");
        let mut r = QdiscReader::new().unwrap();
        let all = r.read().unwrap();
        // A dump may list no qdisc for a device with none; when lo's is listed, it has a kind.
        if let Some(q) = all.get(&lo) {
            assert!(!q.kind.is_empty(), "{q:?}");
        }
        // Twice in a row: the sequence numbers keep the dumps apart.
        r.read().unwrap();
    }
}
