//! A network namespace's share of the rule reader: the reads of one namespace may take at
//! most [`SHARE`] of one core over the last [`WINDOW`] (the reader thread's own CPU time), so
//! a tenant rewriting a 40,000-rule table back to back cannot keep the reader from other
//! namespaces' writes. Past it, that namespace's next read waits until its recent reads fall
//! out of the window (its writes meanwhile are coalesced into that one read); the others are
//! read first.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// The window over which a namespace's reads are summed.
pub const WINDOW: Duration = Duration::from_secs(10);
/// A namespace's share of one core over [`WINDOW`].
pub const SHARE: f64 = 0.1;
/// Namespaces followed; past it the oldest spending is forgotten first (a budget starts over).
const MAX_NAMESPACES: usize = 4096;

/// Each namespace's recent reads: (when, CPU time).
#[derive(Debug, Default)]
pub struct Budget {
    spent: HashMap<u32, VecDeque<(Instant, Duration)>>,
}

impl Budget {
    fn limit() -> Duration {
        WINDOW.mul_f64(SHARE)
    }

    /// The CPU time `netns`'s reads took within the window ending `now`.
    pub fn spent(&mut self, netns: u32, now: Instant) -> Duration {
        let Some(q) = self.spent.get_mut(&netns) else {
            return Duration::ZERO;
        };
        while q
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) >= WINDOW)
        {
            q.pop_front();
        }
        q.iter().map(|(_, d)| *d).sum()
    }

    /// `Ok` when `netns` may be read now, else when it may (its spending under the limit
    /// again as old reads leave the window).
    pub fn allow(&mut self, netns: u32, now: Instant) -> Result<(), Instant> {
        let mut over = match self.spent(netns, now).checked_sub(Self::limit()) {
            Some(d) if !d.is_zero() => d,
            _ => return Ok(()),
        };
        let q = self
            .spent
            .get(&netns)
            .map(|q| q.iter())
            .into_iter()
            .flatten();
        for (t, d) in q {
            if over <= *d {
                return Err(*t + WINDOW);
            }
            over -= *d;
        }
        Err(now + WINDOW)
    }

    /// A read of `netns` at `now` took `cost` of CPU.
    pub fn charge(&mut self, netns: u32, now: Instant, cost: Duration) {
        if !self.spent.contains_key(&netns) && self.spent.len() >= MAX_NAMESPACES {
            // The namespace that spent longest ago.
            let oldest = self
                .spent
                .iter()
                .min_by_key(|(_, q)| q.back().map(|(t, _)| *t))
                .map(|(n, _)| *n);
            if let Some(n) = oldest {
                self.spent.remove(&n);
            }
        }
        self.spent.entry(netns).or_default().push_back((now, cost));
    }
}

/// This thread's CPU time so far (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a plain syscall writing into `ts`.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Under its share a namespace is read at once; past it, only when enough of its reads
    /// left the window; another namespace is not held back.
    #[test]
    fn a_namespace_past_its_share_waits_for_its_reads_to_age() {
        let mut b = Budget::default();
        let t0 = Instant::now();
        // 10 reads of 150 ms, 100 ms apart: 1.5 s within 10 s, over the 1 s limit.
        for i in 0..10 {
            let now = t0 + 100 * MS * i;
            assert!(i < 7 || b.allow(7, now).is_err(), "read {i}");
            b.charge(7, now, 150 * MS);
        }
        let now = t0 + 1000 * MS;
        assert_eq!(b.spent(7, now), 1500 * MS);
        // 500 ms over: the first 4 reads (600 ms) must leave: the 4th at t0 + 300 ms.
        assert_eq!(b.allow(7, now), Err(t0 + 300 * MS + WINDOW));
        assert_eq!(b.allow(8, now), Ok(()));
        assert_eq!(b.allow(7, t0 + 300 * MS + WINDOW), Ok(()));
        assert_eq!(b.spent(7, t0 + 300 * MS + WINDOW), 900 * MS);
    }

    #[test]
    fn namespaces_followed_are_bounded() {
        let mut b = Budget::default();
        let t0 = Instant::now();
        for n in 0..(MAX_NAMESPACES as u32 + 10) {
            b.charge(n, t0 + MS * n, MS);
        }
        assert_eq!(b.spent.len(), MAX_NAMESPACES);
        assert!(!b.spent.contains_key(&0));
    }
}
