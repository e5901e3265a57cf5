//! [`SharedStr`]: an immutable, reference-counted string for the names the analysis hands
//! out (comm, agent, cmdline, lock path, ids). Built once per attribution, then shared by
//! every fact that names the same process: a clone is a reference-count increment, not an
//! allocation. Serialises as a plain JSON string.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use serde::{Serialize, Serializer};

#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SharedStr(Arc<str>);

impl SharedStr {
    /// The empty string, shared: costs no allocation.
    pub fn empty() -> Self {
        static EMPTY: OnceLock<SharedStr> = OnceLock::new();
        EMPTY.get_or_init(|| SharedStr(Arc::from(""))).clone()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Asks the CPU to fetch this string's reference counts ahead of a clone or drop; no
    /// effect on what the program does (see [`prefetch`]).
    pub(crate) fn prefetch(&self) {
        // The counts sit just before the text (`ArcInner`: strong, weak, then the data).
        prefetch(Arc::as_ptr(&self.0).cast::<u8>().wrapping_sub(16));
    }

    /// Same allocation (not merely equal text).
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

/// A hint to the CPU to bring the cache line at `p` in ahead of a use: for memory known to be
/// cold (entries pruned thousands of events after their last use). Never faults, reads
/// nothing, changes nothing; a no-op off x86-64.
#[inline]
pub(crate) fn prefetch(p: *const u8) {
    // SAFETY: SSE is part of the x86-64 baseline, so the instruction exists; a prefetch
    // dereferences nothing and cannot fault, whatever the address.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

impl Default for SharedStr {
    fn default() -> Self {
        Self::empty()
    }
}

impl Deref for SharedStr {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for SharedStr {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for SharedStr {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for SharedStr {
    fn from(s: &str) -> Self {
        if s.is_empty() {
            return Self::empty();
        }
        SharedStr(Arc::from(s))
    }
}

impl From<String> for SharedStr {
    fn from(s: String) -> Self {
        if s.is_empty() {
            return Self::empty();
        }
        SharedStr(Arc::from(s))
    }
}

impl From<&String> for SharedStr {
    fn from(s: &String) -> Self {
        Self::from(s.as_str())
    }
}

impl From<SharedStr> for String {
    fn from(s: SharedStr) -> Self {
        s.0.to_string()
    }
}

impl PartialEq<str> for SharedStr {
    fn eq(&self, o: &str) -> bool {
        &*self.0 == o
    }
}

impl PartialEq<&str> for SharedStr {
    fn eq(&self, o: &&str) -> bool {
        &*self.0 == *o
    }
}

impl PartialEq<String> for SharedStr {
    fn eq(&self, o: &String) -> bool {
        &*self.0 == o.as_str()
    }
}

impl PartialEq<SharedStr> for str {
    fn eq(&self, o: &SharedStr) -> bool {
        self == &*o.0
    }
}

impl PartialEq<SharedStr> for &str {
    fn eq(&self, o: &SharedStr) -> bool {
        *self == &*o.0
    }
}

impl PartialEq<SharedStr> for String {
    fn eq(&self, o: &SharedStr) -> bool {
        self.as_str() == &*o.0
    }
}

impl fmt::Display for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl fmt::Debug for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl Serialize for SharedStr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_like_a_string() {
        let a = SharedStr::from("kube-proxy");
        let b = a.clone();
        assert!(SharedStr::ptr_eq(&a, &b));
        assert_eq!(a, "kube-proxy");
        assert_eq!(a.as_str(), "kube-proxy");
        assert_eq!(format!("{a} {a:?}"), "kube-proxy \"kube-proxy\"");
        assert_eq!(serde_json::to_string(&a).unwrap(), "\"kube-proxy\"");
        assert!(SharedStr::ptr_eq(
            &SharedStr::from(""),
            &SharedStr::default()
        ));
        assert!(a.starts_with("kube"));
    }
}

/// A warning that would repeat every second (an unreadable directory, a full fd table) said
/// at most once per period, with how many times it happened since.
#[derive(Debug)]
pub struct Throttle {
    every: std::time::Duration,
    last: Option<std::time::Instant>,
    since: u64,
}

impl Throttle {
    pub const fn new(every: std::time::Duration) -> Self {
        Throttle {
            every,
            last: None,
            since: 0,
        }
    }

    /// Counts one occurrence; `Some(n)` when it is to be said now, `n` counting this one and
    /// those kept quiet since the last time.
    pub fn hit(&mut self) -> Option<u64> {
        self.since += 1;
        if self.last.is_some_and(|t| t.elapsed() < self.every) {
            return None;
        }
        self.last = Some(std::time::Instant::now());
        Some(std::mem::take(&mut self.since))
    }
}

#[cfg(test)]
mod throttle_tests {
    use super::Throttle;
    use std::time::Duration;

    #[test]
    fn says_once_per_period_with_the_count() {
        let mut t = Throttle::new(Duration::from_secs(3600));
        assert_eq!(t.hit(), Some(1));
        assert_eq!(t.hit(), None);
        assert_eq!(t.hit(), None);
        let mut t = Throttle::new(Duration::ZERO);
        assert_eq!(t.hit(), Some(1));
        assert_eq!(t.hit(), Some(1));
    }
}
