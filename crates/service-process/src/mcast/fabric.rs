//! The emulated multicast fabric: real IP multicast over UDP (see ../shared/DESIGN.md,
//! "UD hardware multicast"). One group address per subgroup of a collective, from a range;
//! senders choose the interface (`IP_MULTICAST_IF`) and a TTL (0 keeps the datagrams on this
//! host, over loopback; 1 lets them cross the bridge of the namespace cluster to the other
//! DPUs, never a router); receivers bind the group's address and port with `SO_REUSEADDR`, so
//! every SP of a host gets its own copy, join it on their interface, and read the kernel's
//! count of datagrams dropped for want of room in their receive buffer (`SO_MEMINFO`): a
//! receiver that is not ready loses datagrams, as an IB UD QP without posted receives does,
//! and that loss is counted, never hidden.

use nix::sys::socket::{self as ns, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};

/// Where a collective's groups live: `base`/`prefix` the address range, ports from
/// `port_base`, sent out of `interface` with `ttl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FabricConfig {
    pub base: Ipv4Addr,
    pub prefix: u8,
    pub port_base: u16,
    pub interface: Ipv4Addr,
    pub ttl: u32,
}

impl Default for FabricConfig {
    /// 239.255.0.0/16 (administratively scoped), on loopback with TTL 0.
    fn default() -> Self {
        FabricConfig {
            base: Ipv4Addr::new(239, 255, 0, 0),
            prefix: 16,
            port_base: 47_000,
            interface: Ipv4Addr::LOCALHOST,
            ttl: 0,
        }
    }
}

impl FabricConfig {
    /// The group of subgroup `sub` of communicator slot `slot`: an address of the range per
    /// (slot, subgroup), wrapping within the range, and a port per slot (so that two
    /// communicators whose addresses wrap onto each other still do not share a socket).
    pub fn group(&self, slot: u32, sub: u16, subgroups: u16) -> SocketAddrV4 {
        let host_bits = 32 - u32::from(self.prefix.min(31));
        let span = 1u64 << host_bits;
        let index = (u64::from(slot) * u64::from(subgroups.max(1)) + u64::from(sub)) % span;
        let base = u32::from(self.base) & !((span - 1) as u32);
        let addr = Ipv4Addr::from(base | index as u32);
        let port = self.port_base.wrapping_add((slot % 1024) as u16);
        SocketAddrV4::new(addr, port)
    }
}

fn os(e: nix::Error) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// A socket that sends to groups out of `cfg.interface` with `cfg.ttl`, looping back to
/// this host's receivers.
pub fn sender(cfg: &FabricConfig) -> io::Result<UdpSocket> {
    let s = UdpSocket::bind(SocketAddrV4::new(cfg.interface, 0))?;
    s.set_multicast_ttl_v4(cfg.ttl)?;
    s.set_multicast_loop_v4(true)?;
    let ifaddr = libc::in_addr {
        s_addr: u32::from(cfg.interface).to_be(),
    };
    // SAFETY: setsockopt on a socket this function owns, with a pointer to an in_addr that
    // lives across the call and its size.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MULTICAST_IF,
            &ifaddr as *const libc::in_addr as *const libc::c_void,
            std::mem::size_of::<libc::in_addr>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(s)
}

/// A socket that receives group `group` on `interface`, with a receive buffer of `rcvbuf`
/// bytes (the kernel doubles it and bounds it by `net.core.rmem_max`). Nonblocking.
pub fn receiver(group: SocketAddrV4, interface: Ipv4Addr, rcvbuf: usize) -> io::Result<UdpSocket> {
    let fd: OwnedFd = ns::socket(
        AddressFamily::Inet,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(os)?;
    ns::setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(os)?;
    ns::setsockopt(&fd, sockopt::RcvBuf, &rcvbuf).map_err(os)?;
    ns::bind(fd.as_raw_fd(), &SockaddrIn::from(group)).map_err(os)?;
    let s = UdpSocket::from(fd);
    s.join_multicast_v4(group.ip(), &interface)?;
    Ok(s)
}

/// One datagram read from a receiver socket into `buf`: its length. A datagram longer than
/// `buf` is an error (its tail was cut off).
pub fn recv(s: &UdpSocket, buf: &mut [u8]) -> io::Result<usize> {
    let mut iov = [io::IoSliceMut::new(buf)];
    let msg =
        ns::recvmsg::<()>(s.as_raw_fd(), &mut iov, None, ns::MsgFlags::MSG_DONTWAIT).map_err(os)?;
    if msg.flags.contains(ns::MsgFlags::MSG_TRUNC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a datagram longer than the receive buffer (truncated)",
        ));
    }
    Ok(msg.bytes)
}

/// The kernel's count of datagrams this socket lost for want of room in its receive buffer
/// (`SO_MEMINFO`'s drops: the receiver was not ready), since it was opened.
pub fn drops(s: &UdpSocket) -> io::Result<u32> {
    // SK_MEMINFO_VARS is 9 on Linux 6 (the drops at SK_MEMINFO_DROPS, 8); room for more.
    let mut info = [0u32; 16];
    let mut len = std::mem::size_of_val(&info) as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, which lives across the call.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MEMINFO,
            info.as_mut_ptr() as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(info[libc::SK_MEMINFO_DROPS as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_stay_in_the_range_and_differ_per_subgroup_and_slot() {
        let cfg = FabricConfig::default();
        let a = cfg.group(0, 0, 4);
        let b = cfg.group(0, 1, 4);
        let c = cfg.group(1, 0, 4);
        assert_ne!(a, b);
        assert_ne!(a, c);
        for slot in [0, 1, 77, 100_000, u32::MAX] {
            for sub in 0..8 {
                let g = cfg.group(slot, sub, 8);
                assert_eq!(g.ip().octets()[..2], [239, 255], "{g}");
                assert!(g.ip().is_multicast());
            }
        }
        let narrow = FabricConfig {
            base: Ipv4Addr::new(239, 1, 2, 0),
            prefix: 24,
            ..cfg
        };
        assert_eq!(narrow.group(1000, 3, 4).ip().octets()[..3], [239, 1, 2]);
    }

    #[test]
    fn two_receivers_of_one_group_each_get_every_datagram_on_loopback() {
        let cfg = FabricConfig {
            port_base: 47_900,
            ..FabricConfig::default()
        };
        let g = cfg.group(std::process::id() % 1000, 0, 1);
        let r1 = receiver(g, cfg.interface, 1 << 20).unwrap();
        let r2 = receiver(g, cfg.interface, 1 << 20).unwrap();
        let s = sender(&cfg).unwrap();
        for i in 0..10u8 {
            s.send_to(&[i; 100], g).unwrap();
        }
        let mut buf = vec![0u8; 2048];
        for r in [&r1, &r2] {
            let mut got = vec![];
            let t = std::time::Instant::now();
            while got.len() < 10 && t.elapsed() < std::time::Duration::from_secs(5) {
                match recv(r, &mut buf) {
                    Ok(n) => {
                        assert_eq!(n, 100);
                        got.push(buf[0]);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(std::time::Duration::from_millis(1))
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            assert_eq!(got, (0..10).collect::<Vec<u8>>());
        }
    }
}
