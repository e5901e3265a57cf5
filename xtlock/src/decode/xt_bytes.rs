//! The bytes both x_tables readers share: the table layout's family, the kernel's
//! native-endian integers and NUL-terminated names, and the digest of what is not decoded.
//! Below `xt_table` (the entries) and `xt_ext` (the extensions), which both import it.

/// Which table layout: `ipt_entry` (iptables) or `ip6t_entry` (ip6tables). Everything after
/// the entry's head (matches, targets, verdicts) is the same `x_tables` format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    /// `family` of a [`crate::event::RuleTable`]: `ip`, `ip6`.
    pub fn name(self) -> &'static str {
        match self {
            Family::Ipv4 => "ip",
            Family::Ipv6 => "ip6",
        }
    }
}

pub(crate) fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// A NUL-terminated name of at most `len` bytes at `at`.
pub(crate) fn name_at(b: &[u8], at: usize, len: usize) -> String {
    let s = b.get(at..at + len).unwrap_or_default();
    let end = s.iter().position(|&c| c == 0).unwrap_or(s.len());
    String::from_utf8_lossy(&s[..end]).into_owned()
}

/// A short digest of bytes xtlock does not decode: equal bytes, equal text.
pub(crate) fn digest(b: &[u8]) -> String {
    // FNV-1a: stable across runs and versions, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in b {
        h = (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:012x}", h >> 16)
}
