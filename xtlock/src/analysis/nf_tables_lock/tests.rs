use crate::analysis::{Analyzer, Output, WaitFact, WaitOutcome};
use crate::decode::{Comm, Event, NftMutex, NftMutexWaitEvent};

const MS: u64 = 1_000_000;
const COMMIT: u64 = 0xffff_8881_fa49_3670;
const NFNL: u64 = 0xffff_ffff_83c4_a610;

#[allow(clippy::too_many_arguments)]
fn wait(
    start: u64,
    end: u64,
    pid: u32,
    comm: &str,
    mutex: NftMutex,
    holder: Option<(u32, &str)>,
) -> Event {
    Event::NftMutexWait(Box::new(NftMutexWaitEvent {
        ts_ns: end,
        start_ns: start,
        tgid: pid,
        tid: pid,
        comm: Comm::new(comm),
        netns: 4026532500,
        mutex,
        lock: match mutex {
            NftMutex::Commit => COMMIT,
            NftMutex::Nfnl => NFNL,
        },
        ret: 0,
        holder: holder.map(|(p, _)| (p, p)),
        holder_comm: Comm::new(holder.map_or("", |(_, c)| c)),
    }))
}

fn waits(a: &mut Analyzer, evs: &[Event]) -> Vec<WaitFact> {
    let mut v = Vec::new();
    for e in evs {
        for o in a.process_collect(e) {
            if let Output::Wait(w) = o {
                v.push(w);
            }
        }
    }
    v
}

/// A wait on a netns's commit mutex is a wait on that netns's nf_tables commit lock, behind
/// the owner when it began, for its whole time.
#[test]
fn a_commit_mutex_wait_is_a_wait_behind_its_owner() {
    let mut a = Analyzer::new(Vec::new());
    let w = waits(
        &mut a,
        &[wait(
            10 * MS,
            598 * MS,
            2588,
            "nft",
            NftMutex::Commit,
            Some((2547, "kube-proxy")),
        )],
    );
    assert_eq!(w.len(), 1);
    let w = &w[0];
    assert_eq!(w.lock.as_str(), "nf_tables commit (netns 4026532500)");
    assert_eq!((w.pid, w.wait_ns), (2588, 588 * MS));
    assert_eq!(w.outcome, WaitOutcome::Acquired);
    assert_eq!(w.holders.len(), 1);
    assert_eq!(w.holders[0].pid, 2547);
    assert_eq!(w.holders[0].comm.as_str(), "kube-proxy");
    assert_eq!(w.holders[0].behind_ns, Some(588 * MS));
    assert_eq!(w.unknown_ns, 0);
}

/// Waiters queued on nfnetlink's mutex: each later one waits behind the owner at its start,
/// then behind each waiter that took the mutex before it; the times add up to the wait.
#[test]
fn waits_split_between_the_holders_that_took_over() {
    let mut a = Analyzer::new(Vec::new());
    let w = waits(
        &mut a,
        &[
            wait(
                100 * MS,
                600 * MS,
                11,
                "nft",
                NftMutex::Nfnl,
                Some((10, "nft")),
            ),
            wait(
                200 * MS,
                610 * MS,
                12,
                "iptables-nft",
                NftMutex::Nfnl,
                Some((10, "nft")),
            ),
            // Free when it began (the owner was handing over): unknown until the first
            // hand-over seen.
            wait(300 * MS, 620 * MS, 13, "nft", NftMutex::Nfnl, None),
        ],
    );
    assert_eq!(w.len(), 3);
    assert!(w.iter().all(|w| w.lock.as_str() == super::NFNL_LOCK));
    let behind = |w: &WaitFact| -> Vec<(u32, u64)> {
        w.holders
            .iter()
            .map(|h| (h.pid, h.behind_ns.unwrap_or(0)))
            .collect()
    };
    assert_eq!(behind(&w[0]), vec![(10, 500 * MS)]);
    assert_eq!(behind(&w[1]), vec![(10, 400 * MS), (11, 10 * MS)]);
    assert_eq!(behind(&w[2]), vec![(11, 10 * MS), (12, 10 * MS)]);
    assert_eq!(w[2].unknown_ns, 300 * MS);
    for w in &w {
        let sum: u64 = w.holders.iter().filter_map(|h| h.behind_ns).sum();
        assert_eq!(sum + w.unknown_ns, w.wait_ns);
    }
}

/// The commit mutexes of two netns are two locks: a hand-over on one is no holder of the
/// other.
#[test]
fn two_mutexes_do_not_mix() {
    let mut a = Analyzer::new(Vec::new());
    let w = waits(
        &mut a,
        &[
            wait(0, 50 * MS, 21, "nft", NftMutex::Commit, Some((20, "nft"))),
            wait(
                10 * MS,
                90 * MS,
                22,
                "nft",
                NftMutex::Nfnl,
                Some((21, "nft")),
            ),
        ],
    );
    assert_eq!(w[1].holders.len(), 1);
    assert_eq!(w[1].holders[0].pid, 21);
    assert_eq!(w[1].holders[0].behind_ns, Some(80 * MS));
}

fn send(enter: u64, exit: u64, pid: u32, comm: &str) -> Event {
    Event::NftSend(Box::new(crate::decode::NftSendEvent {
        ts_ns: exit,
        enter_ns: enter,
        tgid: pid,
        tid: pid,
        comm: Comm::new(comm),
        netns: 4026532500,
        ret: 1024,
        batch: None,
    }))
}

fn holds(a: &mut Analyzer, evs: &[Event]) -> Vec<crate::analysis::HoldFact> {
    let mut v = Vec::new();
    for e in evs {
        for o in a.process_collect(e) {
            if let Output::Hold(h) = o {
                v.push(h);
            }
        }
    }
    v
}

/// A batch's sendmsg() is a hold of its netns's commit lock from where its wait for the
/// mutexes ended (from the call's start when it did not wait) to its return.
#[test]
fn a_batch_holds_from_its_last_wait_to_its_sendmsg_return() {
    let mut a = Analyzer::new(Vec::new());
    let h = holds(
        &mut a,
        &[
            send(0, 400 * MS, 10, "nft"),
            wait(
                10 * MS,
                300 * MS,
                11,
                "nft",
                NftMutex::Nfnl,
                Some((12, "nft")),
            ),
            wait(
                300 * MS,
                410 * MS,
                11,
                "nft",
                NftMutex::Commit,
                Some((10, "nft")),
            ),
            send(5 * MS, 450 * MS, 11, "nft"),
        ],
    );
    assert_eq!(h.len(), 2);
    assert_eq!(h[0].lock.as_str(), "nf_tables commit (netns 4026532500)");
    assert_eq!((h[0].pid, h[0].start_ns, h[0].hold_ns), (10, 0, 400 * MS));
    assert_eq!(
        (h[1].pid, h[1].start_ns, h[1].hold_ns),
        (11, 410 * MS, 40 * MS)
    );
    assert_eq!(h[0].nft, None, "not counted");
}

/// What a batch counted at its sendmsg() did is its hold's.
#[test]
fn a_sendmsg_hold_says_what_its_batch_did() {
    let mut a = Analyzer::new(Vec::new());
    let batch = crate::decode::NftBatch {
        status: "complete",
        added: [0, 2, 40_000, 1, 7, 0, 0, 0],
        deleted: [0, 0, 39_990, 0, 0, 0, 0, 0],
    };
    let Event::NftSend(mut e) = send(0, 400 * MS, 10, "kube-proxy") else {
        unreachable!()
    };
    e.batch = Some(Box::new(batch));
    let h = holds(&mut a, &[Event::NftSend(e)]);
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].nft, Some(batch));
    assert_eq!(h[0].nft.map(|b| b.changes()), Some(80_000));
}

/// Where the nft_commit hook times the batches, their sendmsg() adds no hold.
#[test]
fn no_sendmsg_holds_beside_the_commit_hook() {
    let mut a = Analyzer::new(Vec::new());
    let commit = Event::NftCommit(crate::decode::NftCommitEvent {
        ts_ns: 3 * MS,
        enter_ns: MS,
        tgid: 10,
        tid: 10,
        netns: 4026532500,
        comm: Comm::new("nft"),
        batch: None,
    });
    let h = holds(&mut a, &[commit, send(0, 4 * MS, 10, "nft")]);
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(h[0].hold_ns, 2 * MS);
}

/// A contention that began on a free mutex and saw no other taker is a spin, not a wait;
/// its end is still a hand-over for the waits that follow.
#[test]
fn a_spin_on_a_free_mutex_is_no_wait() {
    let mut a = Analyzer::new(Vec::new());
    let w = waits(
        &mut a,
        &[
            wait(10 * MS, 10 * MS + 8_000, 31, "nft", NftMutex::Commit, None),
            wait(
                10 * MS + 2_000,
                30 * MS,
                32,
                "nft",
                NftMutex::Commit,
                Some((40, "nft")),
            ),
        ],
    );
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].pid, 32);
    let behind: Vec<(u32, u64)> = w[0]
        .holders
        .iter()
        .map(|h| (h.pid, h.behind_ns.unwrap_or(0)))
        .collect();
    assert_eq!(behind, vec![(40, 6_000), (31, 30 * MS - 10 * MS - 8_000)]);
}

/// A contention that began on a free mutex and lasted (another task took it on its fast
/// path, unseen) is a wait behind an unknown holder, not a spin.
#[test]
fn a_long_wait_begun_on_a_free_mutex_is_a_wait_behind_nobody_known() {
    let mut a = Analyzer::new(Vec::new());
    let w = waits(
        &mut a,
        &[wait(
            10 * MS,
            60 * MS,
            31,
            "kworker/1:3",
            NftMutex::Commit,
            None,
        )],
    );
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].holders.is_empty());
    assert_eq!((w[0].wait_ns, w[0].unknown_ns), (50 * MS, 50 * MS));
}

/// A wait on nfnetlink's mutex behind a batch that was itself waiting for its netns's commit
/// mutex names that wait and its holder (the root of the queue), clipped to the time behind
/// the batch; a holder that waited for nothing carries nothing.
#[test]
fn an_nfnl_wait_names_the_commit_holder_behind_its_holder() {
    let mut a = Analyzer::new(Vec::new());
    let w = waits(
        &mut a,
        &[
            // iptables-nft (10) holds nfnetlink's mutex and waits for the commit mutex,
            // held by kube-proxy's nft (5), from 100 to 600 ms.
            wait(
                100 * MS,
                600 * MS,
                10,
                "iptables-nft",
                NftMutex::Commit,
                Some((5, "nft")),
            ),
            // nft (11) waits for nfnetlink's mutex behind 10 from 150 ms; 10 lets it go at
            // 620 ms, after its batch.
            wait(
                150 * MS,
                620 * MS,
                11,
                "nft",
                NftMutex::Nfnl,
                Some((10, "iptables-nft")),
            ),
            // A later nfnetlink wait behind 11, which waited for no commit mutex.
            wait(
                700 * MS,
                800 * MS,
                12,
                "nft",
                NftMutex::Nfnl,
                Some((11, "nft")),
            ),
        ],
    );
    assert_eq!(w.len(), 3);
    assert!(w[0].holders[0].waiting.is_none());
    let h = &w[1].holders[0];
    assert_eq!((h.pid, h.behind_ns), (10, Some(470 * MS)));
    let waiting = h.waiting.as_ref().expect("the holder's own commit wait");
    assert_eq!(waiting.lock.as_str(), "nf_tables commit (netns 4026532500)");
    assert_eq!(waiting.wait_ns, 450 * MS);
    let roots: Vec<(u32, Option<u64>, Option<u64>)> = waiting
        .holders
        .iter()
        .map(|r| (r.pid, r.behind_ns, r.from_ns))
        .collect();
    assert_eq!(roots, vec![(5, Some(450 * MS), Some(150 * MS))]);
    assert!(w[2].holders[0].waiting.is_none());
}

/// A holder that held the commit mutex twice during the commit wait is clipped stretch by
/// stretch: behind the nfnetlink wait's holder only its second turn counts.
#[test]
fn a_commit_holder_holding_twice_is_clipped_by_each_stretch() {
    let mut a = Analyzer::new(Vec::new());
    let commit = |start, end, pid, holder| {
        wait(
            start,
            end,
            pid,
            "nft",
            NftMutex::Commit,
            Some((holder, "nft")),
        )
    };
    let w = waits(
        &mut a,
        &[
            // 6 takes the commit mutex from 5 at 200 ms, 5 takes it back at 300.
            commit(50 * MS, 200 * MS, 6, 5),
            commit(210 * MS, 300 * MS, 5, 6),
            // 10, holding nfnetlink's mutex, waits from 100 to 400 ms: behind 5, 6, then 5.
            commit(100 * MS, 400 * MS, 10, 5),
            // 11 waits for nfnetlink's mutex behind 10 from 350 ms.
            wait(
                350 * MS,
                420 * MS,
                11,
                "nft",
                NftMutex::Nfnl,
                Some((10, "nft")),
            ),
        ],
    );
    let nfnl = w.last().expect("the nfnetlink wait");
    let waiting = nfnl.holders[0].waiting.as_ref().expect("10's commit wait");
    assert_eq!(waiting.wait_ns, 50 * MS);
    let roots: Vec<(u32, Option<u64>, Option<u64>)> = waiting
        .holders
        .iter()
        .map(|r| (r.pid, r.behind_ns, r.from_ns))
        .collect();
    assert_eq!(roots, vec![(5, Some(50 * MS), Some(350 * MS))]);
}
