//! An ipset's name by its index. A `-m set` rule holds only the set's index; iptables-save
//! asks the kernel for the name (`getsockopt(SOL_IP, SO_IP_SET)`, `IP_SET_OP_VERSION` then
//! `IP_SET_OP_GET_BYINDEX`, `linux/netfilter/ipset/ip_set.h`), and so does xtlock, in the
//! network namespace the table is read in (sets are per namespace). The rule reader hands
//! it to the decoders as their set-name look-up (decoding does no I/O itself): a table
//! without set matches never opens the socket.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `SO_IP_SET` (at `SOL_IP`).
const SO_IP_SET: libc::c_int = 83;
const IP_SET_OP_VERSION: u32 = 0x100;
const IP_SET_OP_GET_BYINDEX: u32 = 0x7;
/// `IPSET_MAXNAMELEN`.
const NAME_LEN: usize = 32;

/// Set names asked of the kernel, remembered for one table read.
#[derive(Default)]
pub struct SetNames {
    /// The socket and the protocol version the kernel said; `None` once it failed.
    sock: Option<Option<(OwnedFd, u32)>>,
    names: HashMap<u16, Option<String>>,
}

impl SetNames {
    /// The name of set `index`, `None` when the kernel does not say (no such set, no
    /// ipset module, no CAP_NET_ADMIN).
    pub fn name(&mut self, index: u16) -> Option<String> {
        if let Some(n) = self.names.get(&index) {
            return n.clone();
        }
        let sock = self.sock.get_or_insert_with(open);
        let n = sock.as_ref().and_then(|(fd, v)| by_index(fd, *v, index));
        if self.names.len() < 65_536 {
            self.names.insert(index, n.clone());
        }
        n
    }
}

fn getsockopt(fd: &OwnedFd, buf: &mut [u8]) -> Option<usize> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: buf is valid for len bytes; the kernel writes at most that many.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_IP,
            SO_IP_SET,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    (r == 0).then_some(len as usize)
}

/// A raw socket and the kernel's ipset protocol version (`struct ip_set_req_version`
/// { u32 op, version }).
fn open() -> Option<(OwnedFd, u32)> {
    // SAFETY: a plain socket call; the fd is owned right after.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = [0u8; 8];
    req[..4].copy_from_slice(&IP_SET_OP_VERSION.to_ne_bytes());
    getsockopt(&fd, &mut req)?;
    let version = u32::from_ne_bytes(req[4..8].try_into().ok()?);
    Some((fd, version))
}

/// `struct ip_set_req_get_set` { u32 op, version; union { char name[32]; u16 index } }.
fn by_index(fd: &OwnedFd, version: u32, index: u16) -> Option<String> {
    let mut req = [0u8; 8 + NAME_LEN];
    req[..4].copy_from_slice(&IP_SET_OP_GET_BYINDEX.to_ne_bytes());
    req[4..8].copy_from_slice(&version.to_ne_bytes());
    req[8..10].copy_from_slice(&index.to_ne_bytes());
    if getsockopt(fd, &mut req)? != req.len() {
        return None;
    }
    let name = &req[8..];
    let end = name.iter().position(|&c| c == 0).unwrap_or(NAME_LEN);
    (end > 0).then(|| String::from_utf8_lossy(&name[..end]).into_owned())
}
