use super::*;
use crate::analysis::procs::tests::{exec, exit, fork, seed};
use crate::decode::{Comm, FlockCallEvent, LockEvent, LockOp, TableReplaceEvent};

const DEV: u32 = 25; // 0:25
const INO: u64 = 4242;
const LOCK: &str = "/run/xtables.lock";
const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn lock_ev(ts: u64, pid: u32, comm: &str, owner: u64, op: LockOp, nb: bool) -> Event {
    Event::Lock(LockEvent {
        ts_ns: ts,
        tgid: pid,
        tid: pid,
        comm: Comm::new(comm),
        owner,
        dev: DEV,
        ino: INO,
        op,
        nonblocking: nb,
    })
}
fn acq(ts: u64, pid: u32, comm: &str, owner: u64) -> Event {
    lock_ev(
        ts,
        pid,
        comm,
        owner,
        LockOp::Acquired { exclusive: true },
        false,
    )
}
fn acq_nb(ts: u64, pid: u32, comm: &str, owner: u64) -> Event {
    lock_ev(
        ts,
        pid,
        comm,
        owner,
        LockOp::Acquired { exclusive: true },
        true,
    )
}
fn defer(ts: u64, pid: u32, comm: &str, owner: u64) -> Event {
    lock_ev(ts, pid, comm, owner, LockOp::Deferred, false)
}
fn fail(ts: u64, pid: u32, comm: &str, owner: u64) -> Event {
    lock_ev(ts, pid, comm, owner, LockOp::Failed { errno: 11 }, true)
}
fn rel(ts: u64, pid: u32, comm: &str, owner: u64) -> Event {
    lock_ev(ts, pid, comm, owner, LockOp::Released, false)
}
fn call(ts: u64, enter: u64, pid: u32, owner: u64, ret: i64) -> Event {
    Event::FlockCall(FlockCallEvent {
        ts_ns: ts,
        enter_ns: enter,
        tgid: pid,
        tid: pid,
        owner,
        dev: DEV,
        ino: INO,
        ret,
        cmd: Some(2),
    })
}
fn replace(ts: u64, enter: u64, pid: u32) -> Event {
    Event::TableReplace(TableReplaceEvent {
        ts_ns: ts,
        enter_ns: enter,
        tgid: pid,
        tid: pid,
        level: 0,
        optname: 64,
        optlen: 1000,
        ret: 0,
        head: None,
        head_recorded: true,
        read: false,
        netns: 0,
    })
}
/// An `xt_replace_table` call of `pid`, from `enter` to `ts`.
fn xt_swap(ts: u64, enter: u64, pid: u32) -> Event {
    Event::XtReplace(crate::decode::XtReplaceEvent {
        ts_ns: ts,
        enter_ns: enter,
        tgid: pid,
        tid: pid,
    })
}

/// An analyzer that keeps what it said.
struct Run {
    a: Analyzer,
    out: Vec<Output>,
}

impl Run {
    fn new() -> Self {
        Run {
            a: Analyzer::new(vec![WatchedLock::new(LOCK, DEV, INO)]),
            out: Vec::new(),
        }
    }
    fn feed(&mut self, evs: &[Event]) -> &mut Self {
        for ev in evs {
            self.a.process(ev, &mut |o| self.out.push(o));
        }
        self
    }
    fn finish(&mut self, ts: u64) -> &mut Self {
        self.a.finish(ts, &mut |o| self.out.push(o));
        self
    }
    fn holds(&self) -> Vec<&HoldFact> {
        self.out
            .iter()
            .filter_map(|o| match o {
                Output::Hold(h) => Some(h),
                _ => None,
            })
            .collect()
    }
    fn waits(&self) -> Vec<&WaitFact> {
        self.out
            .iter()
            .filter_map(|o| match o {
                Output::Wait(w) => Some(w),
                _ => None,
            })
            .collect()
    }
    fn timeouts(&self) -> Vec<&TimeoutFact> {
        self.out
            .iter()
            .filter_map(|o| match o {
                Output::Timeout(t) => Some(t),
                _ => None,
            })
            .collect()
    }
    fn failed(&self) -> usize {
        self.out
            .iter()
            .filter(|o| matches!(o, Output::FailedTry(_)))
            .count()
    }
}

/// systemd(1) -> kube-proxy(100); systemd -> calico-node(40); systemd -> firewalld(60).
fn node() -> Vec<Event> {
    vec![
        seed(0, 1, 0, "systemd", Some("0::/init.scope")),
        seed(0, 100, 1, "kube-proxy", None),
        seed(0, 40, 1, "calico-node", None),
        seed(0, 60, 1, "firewalld", None),
    ]
}

/// `parent` runs `argv` as `pid` at `ts`.
fn spawn(ts: u64, parent: u32, pid: u32, parent_comm: &str, argv: &[&str]) -> Vec<Event> {
    vec![
        fork(ts, parent, pid, parent_comm),
        exec(ts + 1, pid, &format!("/usr/sbin/{}", argv[0]), argv),
    ]
}

const RESTORE: &[&str] = &["iptables-restore", "-w", "5", "--noflush", "--counters"];

/// An nft batch sent by firewalld's child is a hold of the second lock, per netns.
#[test]
fn nft_commit_is_a_hold_of_the_second_lock() {
    let mut r = Run::new();
    let mut evs = node();
    evs.extend(spawn(10, 60, 300, "firewalld", &["nft", "-f", "rules.nft"]));
    evs.push(Event::NftCommit(crate::decode::NftCommitEvent {
        ts_ns: 5 * MS,
        enter_ns: 2 * MS,
        tgid: 300,
        tid: 300,
        netns: 4026531840,
        comm: Comm::new("nft"),
        batch: Some(Box::new(crate::decode::NftBatch {
            status: "complete",
            added: [1, 5, 300, 0, 0, 0, 0, 0],
            deleted: [0, 0, 2, 0, 0, 0, 0, 0],
        })),
    }));
    r.feed(&evs);
    let h = r.holds();
    assert_eq!(h.len(), 1, "{:?}", r.out);
    assert_eq!(h[0].lock, "nf_tables commit (netns 4026531840)");
    assert_eq!(
        (
            h[0].pid,
            h[0].who.comm.as_str(),
            h[0].who.agent.as_str(),
            h[0].who.agent_pid
        ),
        (300, "nft", "firewalld", 60)
    );
    assert_eq!((h[0].start_ns, h[0].hold_ns), (2 * MS, 3 * MS));
    assert_eq!(
        r.a.summary().holds["firewalld"].count,
        1,
        "counted with the agent's holds"
    );
    // The batch's changes go with the hold, and into the agent's summary.
    let b = h[0].nft.expect("the batch counted");
    assert_eq!(b.changes(), 308);
    let n = &r.a.summary().nft["firewalld"];
    assert_eq!(
        (
            n.commits,
            n.held_ns,
            n.changes,
            n.largest,
            n.largest_partial
        ),
        (1, 3 * MS, 308, 308, false)
    );
    let json = serde_json::to_value(h[0]).unwrap();
    assert_eq!(
        json["nft"],
        serde_json::json!({"status": "complete", "changes": 308,
            "added": {"tables": 1, "chains": 5, "rules": 300}, "deleted": {"rules": 2}})
    );
}

#[test]
fn release_by_close_from_another_pid() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            // flock() again on a description that holds it: the same hold.
            acq(120, 200, "iptables-restor", 0xA),
            // close() by someone else holding no lock: ignored.
            rel(150, 999, "cat", 0xB),
            // The last reference dropped by another pid (delayed fput).
            rel(100 + 312 * MS, 7, "kworker/0:1", 0xA),
        ]);
    let h = r.holds();
    assert_eq!(h.len(), 1, "{:?}", r.out);
    let h = h[0];
    assert_eq!((h.pid, h.hold_ns, h.start_ns), (200, 312 * MS, 100));
    assert_eq!(h.released_by, Some(7));
    assert_eq!((h.who.agent.as_str(), h.who.role), ("kube-proxy", "proxy"));
    assert_eq!(h.who.comm, "iptables-restor");
    assert_eq!(h.who.cmdline, "iptables-restore -w 5 --noflush --counters");
    assert!(!h.open && !h.incomplete);
}

#[test]
fn forked_child_inherits_the_lock() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            fork(200, 200, 201, "iptables-restor"),
            exit(300, 200, "iptables-restor", Some(0)),
            // The parent's exit closes its fd, but the child still has the description.
            rel(301, 200, "iptables-restor", 0xC),
            // Long after any grace period: the child still holds it.
            replace(5 * S, 5 * S - 10, 999),
        ]);
    assert!(r.holds().is_empty(), "{:?}", r.out);
    r.feed(&[rel(6 * S, 201, "iptables-restor", 0xA)]);
    let h = r.holds();
    assert_eq!(h.len(), 1);
    assert_eq!((h[0].pid, h[0].hold_ns), (200, 6 * S - 100));
    assert_eq!(h[0].released_by, Some(201));
    assert!(!h[0].incomplete);
}

#[test]
fn several_holds_per_restore_exec() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            // *filter ... COMMIT: same description locked again after a release.
            acq(100, 200, "iptables-restor", 0xA),
            replace(100 + 30 * MS, 100 + 10 * MS, 200),
            replace(100 + 50 * MS, 100 + 45 * MS, 200),
            rel(100 + 60 * MS, 200, "iptables-restor", 0xA),
            acq(S, 200, "iptables-restor", 0xA),
            rel(S + 5 * MS, 200, "iptables-restor", 0xA),
            // *nat with a fresh open().
            acq(2 * S, 200, "iptables-restor", 0xB),
            rel(2 * S + 7 * MS, 200, "iptables-restor", 0xB),
        ]);
    let h = r.holds();
    assert_eq!(h.len(), 3);
    assert_eq!(
        h.iter().map(|h| h.hold_ns).collect::<Vec<_>>(),
        [60 * MS, 5 * MS, 7 * MS]
    );
    assert_eq!((h[0].kernel_ns, h[0].replaces), (25 * MS, 2));
    assert_eq!((h[1].kernel_ns, h[1].replaces), (0, 0));
    assert!(h.iter().all(|h| h.who.agent == "kube-proxy"));
    assert_eq!(r.a.summary().holds["kube-proxy"].count, 3);
}

/// `xt_replace_table` counts as `swap_ns` only inside a table replace of the same thread:
/// the kernel also swaps a table in when it first builds it in a netns (under a get), which
/// is no part of `kernel_ns`.
#[test]
fn swap_counts_only_inside_its_replace() {
    let swap = |ts: u64, enter: u64| xt_swap(ts, enter, 200);
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            // Table init under a get: 7 ms, before any replace.
            swap(100 + 9 * MS, 100 + 2 * MS),
            // The replace (10..30 ms) and its swap (20..21 ms).
            swap(100 + 21 * MS, 100 + 20 * MS),
            replace(100 + 30 * MS, 100 + 10 * MS, 200),
            // A swap with no replace after it, then a replace that does not contain it.
            swap(100 + 36 * MS, 100 + 35 * MS),
            replace(100 + 50 * MS, 100 + 45 * MS, 200),
            rel(100 + 60 * MS, 200, "iptables-restor", 0xA),
        ]);
    let h = r.holds();
    assert_eq!((h[0].kernel_ns, h[0].swap_ns), (25 * MS, MS));
}

/// Table reads (`getsockopt`) are part of the hold's kernel time, counted apart: a GET_INFO
/// gives the old table's size, a GET_ENTRIES copies it; neither is a replace nor takes the
/// swap of the replace that follows.
#[test]
fn table_reads_are_kernel_time_of_their_own() {
    let call = |ts: u64, enter: u64, optname: u32, read: bool, entries: u32, bytes: u32| {
        let Event::TableReplace(mut t) = replace(ts, enter, 200) else {
            unreachable!()
        };
        let mut name = [0u8; xtlock_common::XT_TABLE_MAXNAMELEN];
        name[..3].copy_from_slice(b"nat");
        t.optname = optname;
        t.read = read;
        t.head = Some(Box::new(crate::decode::TableHead {
            name,
            entries,
            bytes,
        }));
        Event::TableReplace(t)
    };
    let swap = xt_swap(100 + 21 * MS, 100 + 20 * MS, 200);
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            call(100 + 2 * MS, 100 + MS, 64, true, 84_000, 20 << 20),
            call(100 + 9 * MS, 100 + 3 * MS, 65, true, 0, 20 << 20),
            swap,
            call(100 + 30 * MS, 100 + 10 * MS, 64, false, 84_112, 21 << 20),
            rel(100 + 60 * MS, 200, "iptables-restor", 0xA),
        ]);
    let h = r.holds();
    let h = h[0];
    assert_eq!((h.reads, h.read_ns), (2, 7 * MS));
    assert_eq!((h.replaces, h.kernel_ns, h.swap_ns), (1, 27 * MS, MS));
    let ops: Vec<(&str, Option<u32>, Option<u32>)> = h
        .tables
        .iter()
        .map(|t| (t.op, t.entries, t.bytes))
        .collect();
    assert_eq!(
        ops,
        [
            ("info", Some(84_000), Some(20 << 20)),
            ("entries", None, Some(20 << 20)),
            ("replace", Some(84_112), Some(21 << 20)),
        ]
    );
}

/// A replace with the head of its argument: the hold lists the table, its entries and
/// size, and the time in the kernel; one whose head could not be read says so.
#[test]
fn holds_list_the_tables_they_replaced() {
    let named = |ts: u64, enter: u64, table: &str, entries: u32, bytes: u32, optname: u32| {
        let Event::TableReplace(mut t) = replace(ts, enter, 200) else {
            unreachable!()
        };
        let mut name = [0u8; xtlock_common::XT_TABLE_MAXNAMELEN];
        name[..table.len()].copy_from_slice(table.as_bytes());
        t.optname = optname;
        t.head = Some(Box::new(crate::decode::TableHead {
            name,
            entries,
            bytes,
        }));
        Event::TableReplace(t)
    };
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            named(100 + 30 * MS, 100 + 10 * MS, "nat", 84_112, 21 << 20, 64),
            named(100 + 31 * MS, 100 + 30 * MS, "nat", 84_112, 0, 65),
            replace(100 + 50 * MS, 100 + 45 * MS, 200),
            rel(100 + 60 * MS, 200, "iptables-restor", 0xA),
        ]);
    let h = r.holds();
    let t = &h[0].tables;
    assert_eq!(t.len(), 3);
    assert_eq!(
        (
            t[0].table.as_str(),
            t[0].family,
            t[0].op,
            t[0].entries,
            t[0].bytes,
            t[0].kernel_ns
        ),
        (
            "nat",
            "ip",
            "replace",
            Some(84_112),
            Some(21 << 20),
            20 * MS
        )
    );
    assert_eq!(
        (t[1].op, t[1].entries, t[1].bytes),
        ("counters", Some(84_112), None)
    );
    assert_eq!((t[2].table.as_str(), t[2].entries), ("", None));
    assert_eq!(h[0].kernel_ns, 26 * MS);
    let text = crate::sinks::terminal::hold_text_for_test(h[0]);
    assert!(
        text.contains(
            "26.0 ms in 3 table replaces (nat 84,112 entries 21.0 MiB, table of unknown size); \
             userspace 34.0 ms"
        ),
        "{text}"
    );
    // The summary: per agent, the largest table and where the hold time went.
    let sum = r.a.summary();
    let kp = &sum.tables["kube-proxy"];
    assert_eq!(
        (kp.holds, kp.kernel_ns, kp.userspace_ns),
        (1, 26 * MS, 34 * MS)
    );
    let l = kp.largest.as_ref().unwrap();
    assert_eq!(
        (l.table.as_str(), l.entries, l.bytes),
        ("nat", 84_112, 21 << 20)
    );
    let mut out = Vec::new();
    crate::sinks::Sink::summary(&mut crate::sinks::TerminalSink::new(&mut out), &sum, true)
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains(
            "kube-proxy: nat 84,112 entries 21.0 MiB; 1 holds: kernel 26.0 ms, userspace \
             34.0 ms (mostly userspace)"
        ),
        "{text}"
    );
}

#[test]
fn go_style_poll_is_one_wait_and_counted_tries() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&[seed(0, 500, 1, "portmap", None)])
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[acq(100, 200, "iptables-restor", 0xA)]);
    for i in 0..5 {
        let ts = S + i * 200 * MS;
        r.feed(&[
            fail(ts, 500, "portmap", 0xD),
            call(ts + 1, ts - 10, 500, 0xD, -11),
        ]);
    }
    r.feed(&[
        rel(2 * S, 200, "iptables-restor", 0xA),
        acq_nb(2 * S + 100 * MS, 500, "portmap", 0xD),
        rel(2 * S + 101 * MS, 500, "portmap", 0xD),
    ]);
    assert_eq!(r.failed(), 5);
    let w = r.waits();
    assert_eq!(w.len(), 1, "{:?}", r.out);
    let w = w[0];
    assert_eq!(
        (w.mode, w.outcome, w.tries),
        (WaitMode::Poll, WaitOutcome::Acquired, 5)
    );
    assert_eq!((w.start_ns, w.wait_ns), (S, S + 100 * MS));
    assert_eq!((w.who.agent.as_str(), w.who.role), ("portmap", "cni"));
    assert_eq!(w.holders.len(), 1);
    assert_eq!(
        (w.holders[0].pid, w.holders[0].agent.as_str()),
        (200, "kube-proxy")
    );
    let s = r.a.summary();
    assert_eq!(s.failed_tries["portmap"], 5);
    assert_eq!(s.waits["portmap"].count, 1);
    assert_eq!(r.holds().len(), 2);
    // A success with no failure before it is no wait at all.
    r.feed(&[
        acq_nb(3 * S, 500, "portmap", 0xD),
        rel(3 * S + 1, 500, "portmap", 0xD),
    ]);
    assert_eq!(r.waits().len(), 1);
}

#[test]
fn recycled_pid_gets_the_new_agent() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            rel(200, 200, "iptables-restor", 0xA),
            exit(300, 200, "iptables-restor", Some(0)),
        ])
        .feed(&spawn(
            400,
            40,
            200,
            "calico-node",
            &["iptables-legacy", "-w", "-A", "X"],
        ))
        .feed(&[
            acq(500, 200, "iptables-legacy", 0xB),
            rel(600, 200, "iptables-legacy", 0xB),
        ]);
    let h = r.holds();
    assert_eq!(h.len(), 2);
    assert_eq!(h[0].who.agent, "kube-proxy");
    assert_eq!(
        (h[1].who.agent.as_str(), h[1].who.role),
        ("calico-node", "cni")
    );
    assert_eq!(h[1].who.cmdline, "iptables-legacy -w -A X");
}

#[test]
fn lost_events_do_not_produce_nonsense() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            Event::Lost {
                ts_ns: 50,
                count: 3,
            },
            // Its acquire was lost: the release alone is no hold.
            rel(60, 200, "iptables-restor", 0xA),
            call(61, 55, 200, 0xA, 0),
        ]);
    assert!(r.holds().is_empty());
    assert!(r.waits().is_empty());
    // A hold whose release is lost ends when its process exits.
    r.feed(&[
        acq(100, 200, "iptables-restor", 0xB),
        Event::Lost {
            ts_ns: 150,
            count: 1,
        },
        exit(200 * MS, 200, "iptables-restor", Some(0)),
    ]);
    assert!(r.holds().is_empty(), "the release may still come");
    r.feed(&[replace(2 * S, 2 * S, 999)]);
    let h = r.holds();
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].hold_ns, 200 * MS - 100);
    assert!(h[0].incomplete && !h[0].open);
    // Its late release is then ignored.
    r.feed(&[rel(3 * S, 200, "iptables-restor", 0xB)]);
    assert_eq!(r.holds().len(), 1);
    // A daemon re-locking through the same description after a loss: the release in
    // between was lost, this is a new hold.
    r.feed(&[
        acq(4 * S, 40, "calico-node", 0xD),
        Event::Lost {
            ts_ns: 4 * S + 1,
            count: 2,
        },
        acq(5 * S, 40, "calico-node", 0xD),
        rel(5 * S + 10, 40, "calico-node", 0xD),
    ]);
    let h = r.holds();
    assert_eq!(h.len(), 3);
    assert_eq!((h[1].hold_ns, h[1].incomplete), (S, true));
    assert_eq!((h[2].hold_ns, h[2].incomplete), (10, false));
    let lost: Vec<u64> = r
        .out
        .iter()
        .filter_map(|o| match o {
            Output::Lost(l) => Some(l.total),
            _ => None,
        })
        .collect();
    assert_eq!(lost, [3, 4, 6]);
    assert_eq!(r.a.summary().lost_events, 6);
}

#[test]
fn release_after_exit_is_the_real_end() {
    // The kernel closes files after the exit tracepoint: the release follows the exit.
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            exit(1000, 200, "iptables-restor", Some(0)),
            rel(1010, 200, "iptables-restor", 0xA),
        ]);
    let h = r.holds();
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].hold_ns, 910);
    assert!(!h[0].incomplete);
}

#[test]
fn wait_behind_two_successive_holders() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&spawn(
            10,
            60,
            300,
            "firewalld",
            &["iptables", "-w", "-I", "INPUT"],
        ))
        .feed(&spawn(
            10,
            40,
            400,
            "calico-node",
            &["iptables", "-w", "5", "-A", "cali"],
        ))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            defer(200, 400, "iptables", 0xC),
            defer(201, 300, "iptables", 0xB),
            rel(S, 200, "iptables-restor", 0xA),
            // firewalld's iptables wins the race.
            acq(S + 10, 300, "iptables", 0xB),
            defer(S + 20, 400, "iptables", 0xC), // woken, beaten, deferred again
            call(S + 30, 195, 300, 0xB, 0),
            rel(2 * S, 300, "iptables", 0xB),
            acq(2 * S + 10, 400, "iptables", 0xC),
            call(2 * S + 20, 190, 400, 0xC, 0),
            rel(2 * S + 50, 400, "iptables", 0xC),
        ]);
    let w = r.waits();
    assert_eq!(w.len(), 2, "{:?}", r.out);
    let fw = w.iter().find(|w| w.pid == 300).unwrap();
    assert_eq!(
        (fw.who.agent.as_str(), fw.who.role),
        ("firewalld", "firewall")
    );
    assert_eq!(fw.start_ns, 195, "syscall entry before the deferral");
    assert_eq!(fw.wait_ns, S + 10 - 195);
    assert_eq!(fw.holders.iter().map(|h| h.pid).collect::<Vec<_>>(), [200]);
    let cal = w.iter().find(|w| w.pid == 400).unwrap();
    assert_eq!(cal.who.agent, "calico-node");
    assert_eq!(
        (cal.outcome, cal.mode),
        (WaitOutcome::Acquired, WaitMode::Blocking)
    );
    assert_eq!((cal.start_ns, cal.wait_ns), (190, 2 * S + 10 - 190));
    let holders: Vec<(u32, &str)> = cal
        .holders
        .iter()
        .map(|h| (h.pid, h.agent.as_str()))
        .collect();
    assert_eq!(holders, [(200, "kube-proxy"), (300, "firewalld")]);
    assert_eq!(cal.holders[1].cmdline, "iptables -w -I INPUT");
    // Contention: calico-node waited behind both agents, once each.
    let s = r.a.summary();
    let cells: Vec<(&str, &str, u64)> = s
        .contention
        .iter()
        .map(|c| (c.waiter.as_str(), c.holder.as_str(), c.count))
        .collect();
    assert_eq!(
        cells,
        [
            ("calico-node", "firewalld", 1),
            ("calico-node", "kube-proxy", 1),
            ("firewalld", "kube-proxy", 1)
        ]
    );
}

#[test]
fn acquire_seen_before_the_release_of_the_previous_holder() {
    // The tracepoint fires after the spinlock is dropped: the order can flip.
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&spawn(10, 40, 400, "calico-node", &["iptables", "-w"]))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            defer(200, 400, "iptables", 0xC),
            acq(S, 400, "iptables", 0xC),
            rel(S + 5, 200, "iptables-restor", 0xA),
            call(S + 10, 150, 400, 0xC, 0),
        ]);
    let h = r.holds();
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].hold_ns, S - 100, "clamped to the next acquire");
    assert!(!h[0].incomplete);
    let w = r.waits();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].holders[0].pid, 200);
    // And if a release never comes, the hold still ends (inferred): 400 never released
    // 0xC, 200 never releases 0xE.
    r.feed(&[
        acq(2 * S, 200, "iptables-restor", 0xE),
        acq(3 * S, 400, "iptables", 0xF),
        replace(5 * S, 5 * S, 1),
    ]);
    let h = r.holds();
    assert_eq!(h.len(), 3, "{h:?}");
    assert_eq!((h[1].pid, h[1].hold_ns, h[1].incomplete), (400, S, true));
    assert_eq!((h[2].pid, h[2].hold_ns, h[2].incomplete), (200, S, true));
}

/// The holder's release reaches us before the waiter's acquire but is stamped after it
/// (two CPUs' clocks, 8 µs apart in the VM): the wait still splits into stretches that add
/// up to it, not into more time behind the holder than the wait lasted.
#[test]
fn release_stamped_after_the_acquire_that_ended_the_wait() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&spawn(10, 40, 400, "calico-node", &["iptables", "-w"]))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            defer(200, 400, "iptables", 0xC),
            rel(S + 8_000, 200, "iptables-restor", 0xA),
            acq(S, 400, "iptables", 0xC),
            call(S + 10, 150, 400, 0xC, 0),
        ]);
    let w = r.waits();
    assert_eq!(w.len(), 1, "{:?}", r.out);
    // The wait began at the flock() call (150), its deferral came after.
    assert_eq!(w[0].wait_ns, S - 150);
    assert_eq!(w[0].holders[0].pid, 200);
    assert_eq!(w[0].holders[0].behind_ns, Some(S - 150), "{:?}", w[0]);
    assert_eq!((w[0].free_ns, w[0].unknown_ns), (0, 0));
}

/// A plain iptables never unlocks: the kernel releases the lock when it closes the
/// exited process's files, after the exit event. A blocking take and a LOCK_NB try that
/// land in that window are behind that iptables, and its hold ends at the release.
#[test]
fn exited_holder_holds_until_its_release() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 60, 300, "firewalld", &["iptables", "-A", "X"]))
        .feed(&spawn(10, 40, 400, "calico-node", &["iptables", "-w"]))
        .feed(&[seed(0, 500, 1, "portmap", None)])
        .feed(&[
            acq(100, 300, "iptables", 0xB),
            exit(1_000, 300, "iptables", Some(0)),
            // In the window: after the exit, before the release.
            defer(1_010, 400, "iptables", 0xC),
            fail(1_020, 500, "portmap", 0xD),
            rel(60 * MS, 300, "iptables", 0xB),
            acq(60 * MS + 5, 400, "iptables", 0xC),
            call(60 * MS + 9, 1_010, 400, 0xC, 0),
        ]);
    let h = r.holds();
    assert_eq!(h.len(), 1, "{:?}", r.out);
    assert_eq!(h[0].hold_ns, 60 * MS - 100, "the release, not the exit");
    assert!(!h[0].incomplete);
    let w = r.waits();
    assert_eq!(w.len(), 1, "{:?}", r.out);
    assert_eq!(w[0].holders.len(), 1);
    assert_eq!(
        (w[0].holders[0].pid, w[0].holders[0].agent.as_str()),
        (300, "firewalld")
    );
    assert_eq!(w[0].holders[0].behind_ns, Some(60 * MS - 1_010));
    // From the release to the waiter's acquire the lock was free.
    assert_eq!(w[0].free_ns, 5);
    assert_eq!(w[0].unknown_ns, 0);
    let f: Vec<&FailedTryFact> = r
        .out
        .iter()
        .filter_map(|o| match o {
            Output::FailedTry(f) => Some(f),
            _ => None,
        })
        .collect();
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].holder.as_ref().map(|h| h.pid), Some(300));
    assert!(!r
        .a
        .summary()
        .contention
        .iter()
        .any(|c| c.holder == "(unknown)"));
}

/// Ring order is not time order: the next taker's acquire reaches us before the old
/// holder's release. The hold ends at its real release, bounded above by that acquire,
/// never at its exit.
#[test]
fn late_release_is_the_end_bounded_by_the_next_acquire() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 60, 300, "firewalld", &["iptables", "-A", "X"]))
        .feed(&spawn(10, 40, 400, "calico-node", &["iptables", "-w"]))
        .feed(&[
            acq(100, 300, "iptables", 0xB),
            exit(1_000, 300, "iptables", Some(0)),
            acq(1_300, 400, "iptables", 0xC),
            // Released at 1_200, seen after the acquire.
            rel(1_200, 300, "iptables", 0xB),
        ]);
    let h = r.holds();
    assert_eq!(h.len(), 1, "{:?}", r.out);
    assert_eq!((h[0].pid, h[0].hold_ns), (300, 1_100));
    // The release's time can even be after the acquire's: then the acquire bounds it.
    r.feed(&[
        exit(2_000, 400, "iptables", Some(0)),
        acq(2_300, 100, "kube-proxy", 0xE),
        rel(2_310, 400, "iptables", 0xC),
    ]);
    let h = r.holds();
    assert_eq!(h.len(), 2, "{:?}", r.out);
    assert_eq!((h[1].pid, h[1].hold_ns), (400, 1_000));
    assert!(!h[1].incomplete);
}

/// A deferral that reaches us after the release it waited for (ring order) still names
/// the holder it waited behind.
#[test]
fn deferral_seen_after_the_release_names_the_holder() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&spawn(10, 40, 400, "calico-node", &["iptables", "-w"]))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            rel(1_000, 200, "iptables-restor", 0xA),
            defer(990, 400, "iptables", 0xC),
            acq(1_005, 400, "iptables", 0xC),
            call(1_010, 990, 400, 0xC, 0),
        ]);
    let w = r.waits();
    assert_eq!(w.len(), 1, "{:?}", r.out);
    assert_eq!(w[0].holders.len(), 1, "{:?}", w[0]);
    assert_eq!(w[0].holders[0].pid, 200);
    assert_eq!(w[0].unknown_ns, 0);
}

/// A wait behind kube-proxy then calico-node: the time behind each, adding up to the
/// wait; the metrics and the contention matrix take those shares.
#[test]
fn wait_split_between_successive_holders() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&spawn(10, 40, 300, "calico-node", &["iptables", "-w"]))
        .feed(&[seed(0, 500, 1, "portmap", None)])
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            defer(S, 300, "iptables", 0xB),
            defer(S + 10, 500, "portmap", 0xD),
            rel(2 * S, 200, "iptables-restor", 0xA),
            acq(2 * S + 5, 300, "iptables", 0xB),
            call(2 * S + 6, S, 300, 0xB, 0),
            rel(2 * S + 70 * MS, 300, "iptables", 0xB),
            acq(2 * S + 70 * MS + 5, 500, "portmap", 0xD),
            call(2 * S + 70 * MS + 6, S + 10, 500, 0xD, 0),
        ]);
    let w = r.waits();
    let pm = w.iter().find(|w| w.pid == 500).unwrap();
    let shares: Vec<(&str, Option<u64>)> = pm
        .holders
        .iter()
        .map(|h| (h.agent.as_str(), h.behind_ns))
        .collect();
    assert_eq!(
        shares,
        [
            ("kube-proxy", Some(S - 10)),
            ("calico-node", Some(70 * MS - 5))
        ]
    );
    // The two hand-overs left the lock free 5 ns each.
    assert_eq!(pm.free_ns, 10);
    assert_eq!(pm.wait_ns, S - 5 + 70 * MS);
    assert_eq!(pm.holders[1].from_ns, Some(2 * S + 5));
}

/// Hostile input: thousands of waits and shared holds open at once (distinct pids),
/// each acquire a new holder for every open wait. Open holds and waits are capped and
/// the excess reported; holders per wait are capped and counted.
#[test]
fn open_holds_and_waits_are_bounded() {
    use crate::analysis::xtables_lock::{MAX_HOLDERS, MAX_OPEN_HOLDS, MAX_OPEN_WAITS};
    let mut r = Run::new();
    r.feed(&node());
    let n = 4 * MAX_OPEN_WAITS as u64;
    for i in 0..n {
        let pid = 10_000 + i as u32;
        r.feed(&[
            defer(S + 2 * i, pid, "w", 0x1_0000 + i),
            lock_ev(
                S + 2 * i + 1,
                pid + 100_000,
                "r",
                0x9_0000 + i,
                LockOp::Acquired { exclusive: false },
                false,
            ),
        ]);
    }
    let s = r.a.summary();
    assert_eq!(s.over_bounds["open_waits"], n - MAX_OPEN_WAITS as u64);
    assert_eq!(s.over_bounds["open_holds"], n - MAX_OPEN_HOLDS as u64);
    r.finish(10 * S);
    let w = r.waits();
    assert_eq!(w.len(), MAX_OPEN_WAITS);
    assert!(w.iter().all(|w| w.holders.len() <= MAX_HOLDERS));
    assert!(w.iter().any(|w| w.other_holders > 0));
    for w in &w {
        let named: u64 = w.holders.iter().filter_map(|h| h.behind_ns).sum();
        assert_eq!(
            named + w.unknown_ns + w.other_holders_ns + w.free_ns,
            w.wait_ns,
            "the shares add up to the wait"
        );
    }
    assert!(r
        .out
        .iter()
        .any(|o| matches!(o, Output::Lost(l) if l.bound == Some("open_waits"))));
}

/// The kubelet's names reach every fact of a process in that container, also when they
/// arrive after the process was first attributed.
#[test]
fn pod_names_reach_the_facts() {
    const CID: &str = "3f6e4b0c2a1d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f";
    const UID: &str = "5f3c1e2a-8b7d-4c6e-9a1f-0d2b3c4e5f6a";
    let cg = format!("0::/kubepods/besteffort/pod{UID}/{CID}");
    let pod = |container_id: &str, container: &str| {
        Event::Pod(Box::new(crate::decode::PodInfo {
            ts_ns: 5,
            container_id: container_id.into(),
            pod_uid: UID.into(),
            namespace: "kube-system".into(),
            pod: "kube-proxy-x7k2p".into(),
            container: container.into(),
        }))
    };
    let mut r = Run::new();
    r.feed(&[
        seed(0, 1, 0, "systemd", Some("0::/init.scope")),
        seed(0, 100, 1, "kube-proxy", Some(&cg)),
        acq(10, 100, "kube-proxy", 0xA),
        rel(20, 100, "kube-proxy", 0xA),
        // Only the pod is known at first, then the container.
        pod("", ""),
        acq(30, 100, "kube-proxy", 0xB),
        rel(40, 100, "kube-proxy", 0xB),
        pod(CID, "kube-proxy"),
        acq(50, 100, "kube-proxy", 0xC),
        defer(60, 40, "calico-node", 0xD),
        rel(70, 100, "kube-proxy", 0xC),
    ])
    .finish(100);
    let names: Vec<Option<String>> = r
        .holds()
        .iter()
        .map(|h| h.who.pod.as_ref().map(|p| p.to_string()))
        .collect();
    assert_eq!(
        names,
        [
            None,
            Some("kube-system/kube-proxy-x7k2p".into()),
            Some("kube-system/kube-proxy-x7k2p/kube-proxy".into())
        ]
    );
    let w = r.waits();
    assert_eq!(
        w[0].holders[0]
            .pod
            .as_ref()
            .map(|p| p.to_string())
            .as_deref(),
        Some("kube-system/kube-proxy-x7k2p/kube-proxy")
    );
    let json = serde_json::to_value(&r.out[r.out.len() - 1]).unwrap();
    assert_eq!(
        json["holders"][0]["pod"]["namespace"], "kube-system",
        "{json}"
    );
    assert_eq!(
        json["holders"][0]["pod"]["name"], "kube-proxy-x7k2p",
        "{json}"
    );
    assert_eq!(
        json["holders"][0]["pod"]["container"], "kube-proxy",
        "{json}"
    );
}

#[test]
fn iptables_wait_timeout() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&spawn(
            20,
            40,
            41,
            "calico-node",
            &["sh", "-c", "iptables -w 5 -A X"],
        ))
        .feed(&spawn(
            30,
            41,
            42,
            "sh",
            &["iptables-legacy", "-w", "5", "-A", "X"],
        ))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            defer(S, 42, "iptables-legacy", 0xC),
            call(6 * S, S - 50, 42, 0xC, -4),
            exit(6 * S + 10, 42, "iptables-legacy", Some(4)),
            rel(6 * S + 20, 42, "iptables-legacy", 0xC), // its close: not a hold
        ]);
    let w = r.waits();
    assert_eq!(w.len(), 1);
    let w = w[0];
    assert_eq!((w.outcome, w.ret), (WaitOutcome::TimedOut, Some(-4)));
    assert_eq!((w.start_ns, w.wait_ns), (S - 50, 5 * S + 50));
    assert_eq!(w.who.agent, "calico-node");
    let t = r.timeouts();
    assert_eq!(t.len(), 1);
    let t = t[0];
    assert_eq!(
        (t.pid, t.who.agent.as_str(), t.who.role),
        (42, "calico-node", "cni")
    );
    assert_eq!(t.who.agent_pid, 40, "the agent behind the shell");
    assert_eq!(t.waited_ns, 5 * S + 50);
    assert_eq!(t.holders[0].agent, "kube-proxy");
    let exits: Vec<&ExitFact> = r
        .out
        .iter()
        .filter_map(|o| match o {
            Output::Exit(e) => Some(e),
            _ => None,
        })
        .collect();
    assert_eq!(exits.len(), 1);
    assert!(exits[0].lock_timeout);
    assert_eq!(exits[0].code, Some(4));
    assert_eq!(exits[0].runtime_ns, Some(6 * S + 10 - 31));
    let s = r.a.summary();
    assert_eq!(s.timeouts["calico-node"], 1);
    assert_eq!(s.wait_outcomes["timed_out"], 1);
    assert!(r.holds().is_empty());
}

#[test]
fn timeout_by_erestartsys_and_without_syscall_return() {
    // -ERESTARTSYS, and a run where the syscall-exit probe is missing altogether.
    for with_call in [true, false] {
        let mut r = Run::new();
        r.feed(&node())
            .feed(&spawn(20, 40, 41, "calico-node", &["iptables", "-w", "2"]))
            .feed(&[
                acq(100, 1234, "kube-proxy", 0xA),
                defer(S, 41, "iptables", 0xC),
            ]);
        if with_call {
            r.feed(&[call(3 * S, S, 41, 0xC, -512)]);
        }
        r.feed(&[exit(3 * S + 1, 41, "iptables", Some(4))]);
        let w = r.waits();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].outcome, WaitOutcome::TimedOut);
        assert_eq!(r.timeouts().len(), 1);
        assert_eq!(r.timeouts()[0].holders[0].agent, "kube-proxy");
    }
}

#[test]
fn no_wait_option_fails_once_and_exits_4() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&spawn(20, 60, 61, "firewalld", &["iptables", "-A", "IN"]))
        .feed(&[
            acq(100, 200, "iptables-restor", 0xA),
            fail(S, 61, "iptables", 0xC),
            call(S + 1, S - 5, 61, 0xC, -11),
            exit(S + 100, 61, "iptables", Some(4)),
        ]);
    assert_eq!(r.failed(), 1);
    assert!(r.waits().is_empty(), "a single try is not a wait");
    let t = r.timeouts();
    assert_eq!(t.len(), 1);
    assert_eq!((t[0].who.agent.as_str(), t[0].tries), ("firewalld", 1));
    assert_eq!(t[0].holders[0].pid, 200);
}

#[test]
fn exit_4_without_lock_trouble_is_not_a_lock_timeout() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[exit(S, 200, "iptables-restor", Some(4))]);
    assert!(r.timeouts().is_empty());
    let s = r.a.summary();
    assert!(s.timeouts.is_empty());
    assert_eq!(s.exit4_without_lock["kube-proxy"], 1);
    assert_eq!(s.execs["kube-proxy"], 1);
}

#[test]
fn abandoned_wait_and_old_style_poll_timeout() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(20, 40, 41, "calico-node", &["iptables", "-w"]))
        .feed(&spawn(
            20,
            60,
            61,
            "firewalld",
            &["iptables", "-w", "5", "-W", "100000"],
        ))
        .feed(&[
            acq(100, 1234, "kube-proxy", 0xA),
            defer(S, 41, "iptables", 0xC),
        ]);
    // Old iptables: LOCK_NB every -W µs, then exit 4.
    for i in 0..50 {
        r.feed(&[fail(S + i * 100 * MS, 61, "iptables", 0xE)]);
    }
    r.feed(&[
        exit(6 * S, 61, "iptables", Some(4)),
        exit(7 * S, 41, "iptables", None), // SIGKILL while blocked
    ]);
    let w = r.waits();
    assert_eq!(w.len(), 2);
    assert_eq!(
        (w[0].pid, w[0].mode, w[0].outcome),
        (61, WaitMode::Poll, WaitOutcome::TimedOut)
    );
    assert_eq!((w[0].tries, w[0].wait_ns), (50, 49 * 100 * MS));
    assert_eq!(
        (w[1].pid, w[1].outcome, w[1].wait_ns),
        (41, WaitOutcome::Abandoned, 6 * S)
    );
    assert_eq!(r.timeouts().len(), 1);
    assert_eq!(r.timeouts()[0].tries, 50);
}

#[test]
fn shell_then_restore_is_attributed_to_kube_proxy() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(
            10,
            100,
            150,
            "kube-proxy",
            &["sh", "-c", "iptables-restore"],
        ))
        .feed(&spawn(20, 150, 151, "sh", RESTORE))
        .feed(&[
            acq(100, 151, "iptables-restor", 0xA),
            rel(200, 151, "iptables-restor", 0xA),
        ]);
    let h = r.holds();
    assert_eq!(
        (h[0].who.agent.as_str(), h[0].who.role, h[0].who.agent_pid),
        ("kube-proxy", "proxy", 100)
    );
    let execs: Vec<&ExecFact> = r
        .out
        .iter()
        .filter_map(|o| match o {
            Output::Exec(e) => Some(e),
            _ => None,
        })
        .collect();
    // `sh` is not an iptables binary: one exec shown.
    assert_eq!(execs.len(), 1);
    assert_eq!(execs[0].agent, "kube-proxy");
    assert_eq!(
        execs[0].chain.iter().map(|l| l.pid).collect::<Vec<_>>(),
        [151, 150, 100, 1]
    );
}

#[test]
fn finish_reports_what_is_still_open() {
    let mut r = Run::new();
    r.feed(&node())
        .feed(&[
            acq(100, 100, "kube-proxy", 0xA),
            defer(S, 40, "calico-node", 0xC),
            fail(S, 60, "firewalld", 0xD),
        ])
        .finish(10 * S);
    let h = r.holds();
    assert_eq!(h.len(), 1);
    assert!(h[0].open);
    assert_eq!(h[0].hold_ns, 10 * S - 100);
    let w = r.waits();
    assert_eq!(w.len(), 2);
    assert!(w.iter().all(|w| w.outcome == WaitOutcome::Open));
    let blocking = w.iter().find(|w| w.mode == WaitMode::Blocking).unwrap();
    assert_eq!(blocking.wait_ns, 9 * S);
    assert_eq!(blocking.holders[0].agent, "kube-proxy");
    assert_eq!(r.a.summary().wait_outcomes["open"], 2);
    // The traced time runs to the end of tracing, not to the last event.
    let sum = r.a.summary();
    assert_eq!(sum.duration_ns, 10 * S - sum.first_ts_ns.unwrap());
}

#[test]
fn summary_percentiles_and_contention() {
    let mut r = Run::new();
    r.feed(&node());
    // kube-proxy holds 1..=100 ms; firewalld holds 500 ms once.
    let mut ts = S;
    for i in 1..=100u64 {
        r.feed(&[
            acq(ts, 100, "kube-proxy", i),
            rel(ts + i * MS, 100, "kube-proxy", i),
        ]);
        ts += S;
    }
    r.feed(&[
        acq(ts, 60, "firewalld", 0xF),
        defer(ts + 1, 40, "calico-node", 0xC),
        rel(ts + 500 * MS, 60, "firewalld", 0xF),
        acq(ts + 500 * MS + 1, 100, "kube-proxy", 0x1000),
        rel(ts + 700 * MS, 100, "kube-proxy", 0x1000),
        acq(ts + 700 * MS + 1, 40, "calico-node", 0xC),
        call(ts + 700 * MS + 2, ts, 40, 0xC, 0),
        rel(ts + 800 * MS, 40, "calico-node", 0xC),
    ]);
    let s = r.a.summary();
    let kp = &s.holds["kube-proxy"];
    assert_eq!(kp.count, 101);
    assert!(
        (50 * MS - 100_000..=51 * MS + 100_000).contains(&kp.p50_ns),
        "{}",
        kp.p50_ns
    );
    assert!(
        (99 * MS..=100 * MS + 100_000).contains(&kp.p99_ns),
        "{}",
        kp.p99_ns
    );
    assert_eq!(kp.max_ns, 200 * MS - 1);
    assert_eq!(s.holds["firewalld"].count, 1);
    assert_eq!(s.holds["firewalld"].max_ns, 500 * MS);
    assert_eq!(s.waits["calico-node"].count, 1);
    assert_eq!(s.waits["calico-node"].max_ns, 700 * MS + 1);
    assert_eq!(s.contention.len(), 2);
    // The wait's time is split between its holders: behind firewalld until kube-proxy
    // took the lock, behind kube-proxy after.
    let cells: Vec<(&str, &str, u64, u64)> = s
        .contention
        .iter()
        .map(|c| {
            (
                c.waiter.as_str(),
                c.holder.as_str(),
                c.count,
                c.total_wait_ns,
            )
        })
        .collect();
    assert_eq!(
        cells,
        [
            ("calico-node", "firewalld", 1, 500 * MS),
            ("calico-node", "kube-proxy", 1, 200 * MS - 1)
        ]
    );
    assert_eq!(s.locks.len(), 1);
    assert_eq!(s.locks[0].holds, 103);
    assert_eq!((s.locks[0].dev, s.locks[0].ino), (DEV, INO));
}

#[test]
fn json_field_names() {
    let mut r = Run::new();
    r.feed(&node()).feed(&[
        acq(100, 100, "kube-proxy", 0xffff_8888_0000_1000),
        defer(200, 40, "calico-node", 0xC),
        rel(300, 100, "kube-proxy", 0xffff_8888_0000_1000),
        acq(400, 40, "calico-node", 0xC),
        call(500, 150, 40, 0xC, 0),
    ]);
    let v = |o: &Output| serde_json::to_value(o).unwrap();
    let keys =
        |v: &serde_json::Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    let hold = v(&r
        .out
        .iter()
        .find(|o| matches!(o, Output::Hold(_)))
        .unwrap()
        .clone());
    for k in [
        "type", "lock", "pid", "comm", "agent", "role", "cmdline", "start_ns", "hold_ns",
    ] {
        assert!(hold.get(k).is_some(), "hold lacks {k}: {hold}");
    }
    assert_eq!(hold["type"], "hold");
    assert_eq!(hold["lock"], LOCK);
    assert_eq!(hold["pid"], 100);
    assert_eq!(hold["hold_ns"], 200);
    assert_eq!(hold["owner"], "0xffff888800001000");
    let wait = v(&r
        .out
        .iter()
        .find(|o| matches!(o, Output::Wait(_)))
        .unwrap()
        .clone());
    for k in [
        "type", "lock", "pid", "comm", "agent", "start_ns", "wait_ns", "holders",
    ] {
        assert!(wait.get(k).is_some(), "wait lacks {k}: {wait}");
    }
    assert_eq!(wait["type"], "wait");
    assert_eq!(wait["start_ns"], 150);
    assert_eq!(wait["wait_ns"], 250);
    assert_eq!(wait["outcome"], "acquired");
    assert_eq!(wait["mode"], "blocking");
    assert_eq!(wait["holders"][0]["pid"], 100);
    assert_eq!(wait["holders"][0]["agent"], "kube-proxy");
    let summary = serde_json::to_value(r.a.summary()).unwrap();
    let k = keys(&summary);
    for want in ["type", "holds", "waits", "contention", "lost_events"] {
        assert!(
            k.iter().any(|x| x == want),
            "summary lacks {want}: {summary}"
        );
    }
    assert_eq!(summary["type"], "summary");
    let kp = &summary["holds"]["kube-proxy"];
    for f in ["count", "p50_ns", "p99_ns", "max_ns"] {
        assert!(kp.get(f).is_some(), "{kp}");
    }
    assert_eq!(kp["count"], 1);
    let c = &summary["contention"][0];
    assert_eq!(c["waiter"], "calico-node");
    assert_eq!(c["holder"], "kube-proxy");
    assert_eq!(c["count"], 1);
    // Behind kube-proxy until its release; the lock was free for the last 100 ns.
    assert_eq!(c["total_wait_ns"], 150);
    assert_eq!(wait["free_ns"], 100);
    assert_eq!(summary["lost_events"], 0);
    // The JSON sink: one object per line, the summary last.
    use crate::sinks::{JsonSink, Sink};
    let mut sink = JsonSink::new(Vec::new());
    for o in &r.out {
        sink.output(o).unwrap();
    }
    sink.summary(&r.a.summary(), false).unwrap();
    sink.summary(&r.a.summary(), true).unwrap();
    let text = String::from_utf8(sink.into_inner()).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), r.out.len() + 1);
    assert_eq!(lines.last().unwrap()["type"], "summary");
    assert!(lines[..lines.len() - 1]
        .iter()
        .all(|l| l["type"] != "summary"));
}

#[test]
fn analyzer_and_sinks_can_move_to_another_thread() {
    fn send<T: Send>() {}
    send::<Analyzer>();
    send::<Output>();
    send::<crate::sinks::TerminalSink<std::io::Stdout>>();
    send::<crate::sinks::JsonSink<std::io::Stdout>>();
}

#[test]
fn lock_events_without_facts_do_not_allocate() {
    let mut r = Run::new();
    r.feed(&node()).feed(&[
        acq(100, 100, "kube-proxy", 0xA),
        rel(200, 100, "kube-proxy", 0xA),
    ]);
    let before = r.out.len();
    // A counter update: a replace is a rule write now, a fact of its own.
    let mut counters = replace(302, 301, 40);
    if let Event::TableReplace(t) = &mut counters {
        t.optname = xtlock_common::XT_SO_SET_ADD_COUNTERS;
    }
    let evs = [
        rel(300, 40, "calico-node", 0xB),
        call(301, 299, 40, 0xB, 0),
        counters,
    ];
    let mut n = 0;
    let allocs = alloc_count::count(|| {
        for ev in &evs {
            r.a.process(ev, &mut |_| n += 1);
        }
    });
    assert_eq!(n, 0);
    assert_eq!(allocs, 0);
    assert_eq!(r.out.len(), before);
}

/// Rough throughput check: `cargo test --release -p xtlock --lib -- --ignored --nocapture`.
#[test]
#[ignore]
fn throughput() {
    let mut r = Run::new();
    r.feed(&node());
    let mut evs = Vec::new();
    for i in 0..250_000u64 {
        let ts = S + i * 4_000;
        evs.push(acq(ts, 100, "kube-proxy", 0xA));
        evs.push(fail(ts + 1_000, 40, "calico-node", 0xB));
        evs.push(rel(ts + 2_000, 100, "kube-proxy", 0xA));
        evs.push(rel(ts + 3_000, 60, "firewalld", 0xC));
    }
    let t = std::time::Instant::now();
    let mut n = 0u64;
    for ev in &evs {
        r.a.process(ev, &mut |_| n += 1);
    }
    let el = t.elapsed();
    println!(
        "{} events, {} facts in {:?}: {:.2} M events/s",
        evs.len(),
        n,
        el,
        evs.len() as f64 / el.as_secs_f64() / 1e6
    );
}

/// Counts allocations made by the current thread.
mod alloc_count {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    struct Counting;

    thread_local! {
        static COUNT: Cell<u64> = const { Cell::new(0) };
    }

    // SAFETY: forwards to the system allocator; only counts.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            COUNT.with(|c| c.set(c.get() + 1));
            // SAFETY: same contract as ours.
            unsafe { System.alloc(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            // SAFETY: same contract as ours.
            unsafe { System.dealloc(p, l) }
        }
    }

    #[global_allocator]
    static A: Counting = Counting;

    pub fn count(f: impl FnOnce()) -> u64 {
        let start = COUNT.with(Cell::get);
        f();
        COUNT.with(Cell::get) - start
    }
}

fn stalls(r: &Run) -> Vec<StallFact> {
    r.out
        .iter()
        .filter_map(|o| match o {
            Output::Stall(s) => Some(s.clone()),
            _ => None,
        })
        .collect()
}

/// firewalld's `--reload`: restores a few ms apart, then nothing for minutes while it runs. A
/// burst is not a period: no stall. The same agent with a real cadence later still stalls.
#[test]
fn a_burst_of_restores_is_not_a_cadence() {
    let mut r = Run::new();
    r.feed(&node());
    let restore = |r: &mut Run, ts: u64, pid: u32| {
        r.feed(&spawn(ts, 60, pid, "firewalld", RESTORE))
            .feed(&[exit(ts + 2 * MS, pid, "iptables-restor", Some(0))]);
    };
    for i in 0..6u32 {
        restore(&mut r, S + u64::from(i) * 3_600_000, 1000 + i);
    }
    for t in [2, 5, 30, 120] {
        r.feed(&[exit(t * S, 5000 + t as u32, "sh", Some(0))]);
    }
    assert!(stalls(&r).is_empty(), "{:?}", stalls(&r));
    assert_eq!(r.a.summary().syncs["firewalld"].usual_period_ns, None);
    // Then restores 10 s apart (each a burst of two): a cadence, whose stop is a stall.
    for i in 0..4u32 {
        let ts = 200 * S + u64::from(i) * 10 * S;
        restore(&mut r, ts, 2000 + 2 * i);
        restore(&mut r, ts + 5 * MS, 2001 + 2 * i);
    }
    assert_eq!(
        r.a.summary().syncs["firewalld"].usual_period_ns,
        Some(10 * S - 5 * MS)
    );
    r.feed(&[exit(260 * S, 6000, "sh", Some(0))]);
    let s = stalls(&r);
    assert_eq!(s.len(), 1, "{s:?}");
    assert_eq!(s[0].reason, "no_sync");
}

/// kube-proxy's restores every 10 s, then none for 31 s while it runs: a stall, ended by the
/// next completed restore. Three restores in a row that time out are one too. A process
/// that is gone does not stall.
#[test]
fn restores_that_stop_completing_are_a_stall() {
    let mut r = Run::new();
    r.feed(&node());
    let restore = |r: &mut Run, ts: u64, pid: u32, code: i32| {
        r.feed(&spawn(ts, 100, pid, "kube-proxy", RESTORE))
            .feed(&[exit(ts + 50 * MS, pid, "iptables-restor", Some(code))]);
    };
    for i in 0..4u32 {
        restore(&mut r, u64::from(i) * 10 * S, 1000 + i, 0);
    }
    // 20 s after the last: twice the period, not more.
    r.feed(&[exit(50 * S + 50 * MS, 5000, "sh", Some(0))]);
    assert!(stalls(&r).is_empty(), "{:?}", stalls(&r));
    r.feed(&[exit(61 * S, 5001, "sh", Some(0))]);
    let s = stalls(&r);
    assert_eq!(s.len(), 1, "{s:?}");
    assert_eq!(
        (s[0].agent.as_str(), s[0].stalled, s[0].reason),
        ("kube-proxy", true, "no_sync")
    );
    assert_eq!(s[0].usual_period_ns, Some(10 * S));
    assert_eq!(s[0].since_last_sync_ns, Some(31 * S - 50 * MS));
    assert!(r.a.summary().syncs["kube-proxy"].stalled);
    // Said once, then ended by the next completed restore.
    r.feed(&[exit(70 * S, 5002, "sh", Some(0))]);
    restore(&mut r, 75 * S, 2000, 0);
    let s = stalls(&r);
    assert_eq!(s.len(), 2, "{s:?}");
    assert_eq!((s[1].stalled, s[1].reason), (false, "synced"));
    let text = crate::sinks::terminal::stall_text_for_test(&s[0]);
    assert!(
        text.contains(
            "kube-proxy stalled: no completed iptables-restore for 30.9 s (usually every 10.0 s)"
        ),
        "{text}"
    );
    // Restores that keep giving up on the lock.
    for i in 0..3u32 {
        restore(&mut r, 80 * S + u64::from(i) * S, 3000 + i, 4);
    }
    let s = stalls(&r);
    assert_eq!(s.len(), 3, "{s:?}");
    assert_eq!(
        (s[2].reason, s[2].timeouts_in_row),
        ("restores_time_out", 3)
    );
    // A stalled agent that is gone: nothing more.
    r.feed(&[exit(85 * S, 100, "kube-proxy", Some(0))]);
    r.feed(&[exit(200 * S, 5003, "sh", Some(0))]);
    assert_eq!(stalls(&r).len(), 3);
}

/// Two CPUs read the clock a few µs apart: a deferral stamped just before the acquire of the
/// holder it waited behind. The wait is behind that holder from its start, not "unknown";
/// a holder much later than the wait's start is not taken back.
#[test]
fn first_holder_stamped_just_after_the_wait_holds_it_from_the_start() {
    let mut r = Run::new();
    r.feed(&node()).feed(&[
        defer(1_000, 40, "calico-node", 0xC),
        acq(2_200, 100, "kube-proxy", 0xA),
        rel(90_000, 100, "kube-proxy", 0xA),
        acq(90_100, 40, "calico-node", 0xC),
        call(90_200, 1_000, 40, 0xC, 0),
        rel(95_000, 40, "calico-node", 0xC),
        // 200 µs of nobody known: that stays unknown.
        defer(S, 60, "firewalld", 0xF),
        acq(S + 200_000, 100, "kube-proxy", 0xB),
        rel(S + 300_000, 100, "kube-proxy", 0xB),
        acq(S + 300_100, 60, "firewalld", 0xF),
        call(S + 300_200, S, 60, 0xF, 0),
    ]);
    let w = r.waits();
    let cn = w.iter().find(|w| w.pid == 40).unwrap();
    assert_eq!(cn.unknown_ns, 0, "{cn:?}");
    assert_eq!(cn.holders[0].behind_ns, Some(89_000));
    let fw = w.iter().find(|w| w.pid == 60).unwrap();
    assert_eq!(fw.unknown_ns, 200_000, "{fw:?}");
}

/// A restore is known by the program exec'd, not the comm the kernel cut: Felix's
/// `iptables-legacy-restore` (comm `iptables-legacy`) counts as a sync and its timeouts in a
/// row stall the agent, like `iptables-restore`'s. A restore that hangs is a stall while it
/// runs (past 20 times the agent's usual restore, and at least 5 s), ended when it exits.
#[test]
fn restores_by_any_name_and_a_hung_one() {
    for (name, comm) in [
        ("iptables-legacy-restore", "iptables-legacy"),
        ("ip6tables-legacy-restore", "ip6tables-legac"),
        ("iptables-nft-restore", "iptables-nft-re"),
    ] {
        let mut r = Run::new();
        r.feed(&node());
        let restore = |r: &mut Run, ts: u64, pid: u32, code: i32, took: u64| {
            r.feed(&spawn(ts, 40, pid, "calico-node", &[name, "-w", "1"]))
                .feed(&[exit(ts + took, pid, comm, Some(code))]);
        };
        for i in 0..4u32 {
            restore(&mut r, u64::from(i) * 4 * S, 1000 + i, 0, 30 * MS);
        }
        assert_eq!(
            r.a.summary().syncs[&"calico-node".to_string()].syncs,
            4,
            "{name}"
        );
        for i in 0..3u32 {
            restore(&mut r, 14 * S + u64::from(i) * 1100 * MS, 2000 + i, 4, S);
        }
        let s = stalls(&r);
        assert_eq!(s.len(), 1, "{name}: {s:?}");
        assert_eq!((s[0].stalled, s[0].reason), (true, "restores_time_out"));
        restore(&mut r, 18 * S, 3000, 0, 30 * MS);
        let s = stalls(&r);
        assert_eq!(
            (s.len(), s[1].stalled, s[1].reason),
            (2, false, "synced"),
            "{name}"
        );

        // One that hangs: seen at the first check past 5 s, while it runs.
        r.feed(&spawn(19 * S, 40, 4000, "calico-node", &[name, "-w"]));
        r.feed(&[exit(23 * S, 5000, "sh", Some(0))]);
        assert_eq!(stalls(&r).len(), 2, "{name}: not hung before 5 s");
        r.feed(&[exit(24 * S + 10 * MS, 5001, "sh", Some(0))]);
        let s = stalls(&r);
        assert_eq!(s.len(), 3, "{name}: {s:?}");
        assert_eq!((s[2].stalled, s[2].reason), (true, "restore_hung"));
        let h = s[2].restore.as_ref().unwrap();
        // Exec to exit: the exec comes 1 ns after the fork.
        assert_eq!((h.pid, h.usual_ns), (4000, Some(30 * MS - 1)));
        assert!(h.running_ns > 5 * S, "{h:?}");
        let text = crate::sinks::terminal::stall_text_for_test(&s[2]);
        assert!(
            text.contains("its iptables-restore (pid 4000) has run for 5.0")
                && text.contains("usually take 30.0 ms"),
            "{text}"
        );
        // Killed: the hang ends, without a sync.
        r.feed(&[exit(30 * S, 4000, comm, None)]);
        let s = stalls(&r);
        assert_eq!(s.len(), 4, "{name}: {s:?}");
        assert_eq!((s[3].stalled, s[3].reason), (false, "restore_ended"));
        assert_eq!(r.a.summary().syncs[&"calico-node".to_string()].syncs, 5);
    }
}

fn nft_commit(ts: u64, pid: u32, netns: u32, changes: u32) -> Event {
    Event::NftCommit(crate::decode::NftCommitEvent {
        ts_ns: ts,
        enter_ns: ts - MS,
        tgid: pid,
        tid: pid,
        netns,
        comm: Comm::new("iptables-nft-re"),
        batch: Some(Box::new(crate::decode::NftBatch {
            status: "complete",
            added: [0, 0, changes, 0, 0, 0, 0, 0],
            deleted: [0; 8],
        })),
    })
}

fn legacy_replace(ts: u64, pid: u32, netns: u32) -> Event {
    let mut name = [0u8; xtlock_common::XT_TABLE_MAXNAMELEN];
    name[..6].copy_from_slice(b"filter");
    Event::TableReplace(TableReplaceEvent {
        ts_ns: ts,
        enter_ns: ts - 10_000,
        tgid: pid,
        tid: pid,
        level: xtlock_common::SOL_IP,
        optname: xtlock_common::XT_SO_SET_REPLACE,
        optlen: 1000,
        ret: 0,
        head: Some(Box::new(crate::decode::TableHead {
            name,
            entries: 6,
            bytes: 1000,
        })),
        head_recorded: true,
        read: false,
        netns,
    })
}

/// kube-proxy writes through nf_tables and calico-node through legacy xtables in one netns:
/// each write is counted per agent and backend, and the netns is said once as holding both.
/// Another netns written by one backend only, a failed replace, a table read and an empty
/// batch are not mixed writes.
#[test]
fn both_backends_in_one_netns_are_said_once() {
    const NS: u32 = 4026532001;
    const OTHER: u32 = 4026532002;
    let mut r = Run::new();
    r.feed(&node());
    r.feed(&spawn(
        MS,
        100,
        500,
        "kube-proxy",
        &["iptables-nft-restore", "-w"],
    ))
    .feed(&[
        nft_commit(2 * MS, 500, NS, 40),
        nft_commit(3 * MS, 500, NS, 0),
    ]);
    r.feed(&spawn(
        4 * MS,
        40,
        600,
        "calico-node",
        &["iptables-legacy", "-A", "X"],
    ));
    let mut failed = legacy_replace(5 * MS, 600, OTHER);
    if let Event::TableReplace(t) = &mut failed {
        t.ret = -1;
    }
    r.feed(&[failed]);
    let mixed = |r: &Run| -> Vec<MixedBackendsFact> {
        r.out
            .iter()
            .filter_map(|o| match o {
                Output::MixedBackends(m) => Some(m.clone()),
                _ => None,
            })
            .collect()
    };
    assert!(mixed(&r).is_empty(), "{:?}", r.out);
    r.feed(&[legacy_replace(6 * MS, 600, OTHER)]);
    assert!(mixed(&r).is_empty(), "another netns: {:?}", mixed(&r));
    r.feed(&[
        legacy_replace(7 * MS, 600, NS),
        legacy_replace(8 * MS, 600, NS),
    ]);
    let m = mixed(&r);
    assert_eq!(m.len(), 1, "{m:?}");
    assert_eq!(m[0].netns, NS);
    assert_eq!(
        m[0].legacy,
        vec!["calico-node (iptables-legacy)".to_string()]
    );
    assert_eq!(
        m[0].nft,
        vec!["kube-proxy (iptables-nft-restore)".to_string()]
    );
    let writes: Vec<(String, &str, u32)> = r
        .out
        .iter()
        .filter_map(|o| match o {
            Output::RuleWrite(w) => Some((w.agent.to_string(), w.backend.as_str(), w.netns)),
            _ => None,
        })
        .collect();
    assert_eq!(
        writes,
        vec![
            ("kube-proxy".to_string(), "nft", NS),
            ("calico-node".to_string(), "legacy", OTHER),
            ("calico-node".to_string(), "legacy", NS),
            ("calico-node".to_string(), "legacy", NS),
        ]
    );
    let s = r.a.summary();
    let rows: Vec<(&str, &str, u64)> = s
        .rule_writes
        .iter()
        .map(|w| (w.agent.as_str(), w.backend.as_str(), w.writes.writes))
        .collect();
    assert_eq!(
        rows,
        vec![("calico-node", "legacy", 3), ("kube-proxy", "nft", 1)]
    );
    assert_eq!(s.mixed_backends.len(), 1);
    // The summary's picture: the same agents, and the last write seen (a repeated writer
    // updates it in place).
    let last = &s.mixed_backends[0];
    assert_eq!(
        (last.legacy.clone(), last.nft.clone()),
        (m[0].legacy.clone(), m[0].nft.clone())
    );
    assert_eq!(
        (last.ts_ns, last.agent.as_str(), last.pid),
        (8 * MS, "calico-node", 600)
    );
    let text = crate::sinks::terminal::mixed_backends_text(&m[0], 0);
    assert!(
        text.contains("both iptables backends hold rules in netns 4026532001: legacy (xtables) written by calico-node (iptables-legacy); nf_tables by kube-proxy (iptables-nft-restore)"),
        "{text}"
    );
}

/// The source's `Proc` info names the binary a writer runs, as resolved on disk, with its
/// version: the write says it.
#[test]
fn a_write_names_its_binary() {
    let mut r = Run::new();
    r.feed(&node());
    r.feed(&spawn(
        MS,
        40,
        600,
        "calico-node",
        &["iptables-legacy", "-A", "X"],
    ));
    r.feed(&[Event::Proc(crate::decode::ProcInfo {
        ts_ns: MS + 2,
        pid: 600,
        exe: Some(Box::new(crate::event::ExeInfo {
            path: "/usr/sbin/xtables-legacy-multi".into(),
            version: Some("1.8.9 (legacy)".into()),
        })),
        ..Default::default()
    })]);
    r.feed(&[legacy_replace(2 * MS, 600, 4026532001)]);
    let w: Vec<&RuleWriteFact> = r
        .out
        .iter()
        .filter_map(|o| match o {
            Output::RuleWrite(w) => Some(w),
            _ => None,
        })
        .collect();
    assert_eq!(w.len(), 1, "{:?}", r.out);
    assert_eq!(
        w[0].binary.as_deref(),
        Some("xtables-legacy-multi 1.8.9 (legacy)")
    );
}

/// Where the nft_commit hook does not attach, the read that follows an nf_tables writer's
/// exit counts its write (once per read, at the writer's exit): kube-proxy's
/// `iptables-nft-restore` is a write with backend nft, and with calico-node's legacy write
/// the netns is said mixed. A read with a commit before it adds none.
#[test]
fn an_nft_read_without_a_commit_counts_its_writer() {
    const NS: u32 = 4026532011;
    let mut r = Run::new();
    r.feed(&node());
    r.feed(&spawn(
        MS,
        100,
        500,
        "kube-proxy",
        &["iptables-nft-restore", "-w"],
    ));
    r.feed(&[Event::Exit(crate::decode::ExitEvent {
        ts_ns: 2 * MS,
        tgid: 500,
        tid: 500,
        comm: Comm::new("iptables-nft-re"),
        exit_code: Some(0),
    })]);
    let kp: &[(&str, &[&str])] = &[("KUBE-SERVICES", &["-j ACCEPT"])];
    // Two tables of one read: one write.
    r.feed(&nft_read(
        60 * MS,
        NS,
        500,
        &[("nft ip", "nat", kp), ("nft ip", "filter", kp)],
    ));
    let writes = |r: &Run| -> Vec<(String, &str, u64, u32)> {
        r.out
            .iter()
            .filter_map(|o| match o {
                Output::RuleWrite(w) => {
                    Some((w.agent.to_string(), w.backend.as_str(), w.ts_ns, w.pid))
                }
                _ => None,
            })
            .collect()
    };
    assert_eq!(
        writes(&r),
        vec![("kube-proxy".to_string(), "nft", 2 * MS, 500)],
        "{:?}",
        r.out
    );
    r.feed(&spawn(
        70 * MS,
        40,
        600,
        "calico-node",
        &["iptables-legacy", "-A", "X"],
    ));
    r.feed(&[legacy_replace(71 * MS, 600, NS)]);
    let mixed: Vec<&MixedBackendsFact> = r
        .out
        .iter()
        .filter_map(|o| match o {
            Output::MixedBackends(m) => Some(m),
            _ => None,
        })
        .collect();
    assert_eq!(mixed.len(), 1, "{:?}", r.out);
    assert_eq!(
        mixed[0].nft,
        vec!["kube-proxy (iptables-nft-restore)".to_string()]
    );
    // With the hook: the commit is the write, and the read after it adds none; nor does
    // the second read its writer's exit asks for, with no write pending any more (the 6.12
    // guest counted `nft add rule` twice).
    r.feed(&[nft_commit(80 * MS, 500, NS, 3)]);
    r.feed(&nft_read(90 * MS, NS, 500, &[("nft ip", "nat", kp)]));
    assert_eq!(writes(&r).len(), 3, "{:?}", writes(&r));
    r.feed(&nft_read(150 * MS, NS, 500, &[("nft ip", "nat", kp)]));
    assert_eq!(writes(&r).len(), 3, "{:?}", writes(&r));
}

/// (family, table, chains of (name, rules)).
type NftTableSpec<'a> = (&'a str, &'a str, &'a [(&'a str, &'a [&'a str])]);

/// An nf_tables read of netns `ns` at `ts`: `tables` as (family, table, chains of (name,
/// rules)); every chain's rules are sent.
fn nft_read(ts: u64, ns: u32, pid: u32, tables: &[NftTableSpec]) -> Vec<Event> {
    tables
        .iter()
        .map(|(family, table, chains)| {
            Event::RuleTable(Box::new(crate::event::RuleTable {
                ts_ns: ts,
                netns: ns,
                family: family.to_string(),
                table: table.to_string(),
                after_pid: pid,
                skipped: String::new(),
                chains: chains
                    .iter()
                    .map(|(name, rules)| {
                        let rules: Vec<crate::event::Rule> = rules
                            .iter()
                            .map(|r| crate::event::Rule(r.split(' ').map(str::to_string).collect()))
                            .collect();
                        crate::event::ChainState {
                            name: (*name).into(),
                            policy: None,
                            digest: crate::event::digest_rules(&rules),
                            rules: Some(rules),
                        }
                    })
                    .collect(),
                more: false,
            }))
        })
        .collect()
}

/// nf_tables reads cover every table of a netns at once: the commits before a read name its
/// writers in every table's change (two agents: ambiguous), and only until the next read; a
/// table new since the netns's last read was made by the write; a skipped namespace read
/// makes the next read a baseline again.
#[test]
fn nft_reads_cover_every_table_of_a_netns() {
    const NS: u32 = 4026532009;
    let changes = |r: &Run| -> Vec<RuleChangeFact> {
        r.out
            .iter()
            .filter_map(|o| match o {
                Output::RuleChange(c) => Some(c.clone()),
                _ => None,
            })
            .collect()
    };
    let mut r = Run::new();
    r.feed(&node());
    let kp: &[(&str, &[&str])] = &[("KUBE-SERVICES", &["-j ACCEPT"])];
    r.feed(&nft_read(MS, NS, 100, &[("nft ip", "filter", kp)]));
    assert!(changes(&r).is_empty(), "the first read is the baseline");
    // Two agents commit, then one read: a new table, and a changed one.
    r.feed(&[
        nft_commit(2 * MS, 100, NS, 1),
        nft_commit(3 * MS, 60, NS, 1),
    ]);
    let fw: &[(&str, &[&str])] = &[("filter_INPUT", &["-j DROP"])];
    let kp2: &[(&str, &[&str])] = &[("KUBE-SERVICES", &["-j ACCEPT", "-j RETURN"])];
    r.feed(&nft_read(
        4 * MS,
        NS,
        60,
        &[("nft ip", "filter", kp2), ("nft inet", "firewalld", fw)],
    ));
    let c = changes(&r);
    assert_eq!(c.len(), 2, "{c:?}");
    for c in &c {
        assert!(c.ambiguous, "{c:?}");
        assert_eq!(c.agent, "kube-proxy, firewalld");
    }
    assert_eq!(c[1].family, "nft inet");
    assert_eq!(c[1].diff.created, ["filter_INPUT"]);
    // The next read covers only the commit after the last one.
    r.feed(&[nft_commit(5 * MS, 100, NS, 1)]);
    r.feed(&nft_read(
        6 * MS,
        NS,
        100,
        &[("nft ip", "filter", kp), ("nft inet", "firewalld", fw)],
    ));
    let c = changes(&r);
    assert_eq!(c.len(), 3, "{c:?}");
    assert_eq!((c[2].agent.as_str(), c[2].ambiguous), ("kube-proxy", false));
    assert_eq!(
        c[2].diff.removed,
        [("KUBE-SERVICES".to_string(), "-j RETURN".to_string())]
    );
    // Not read: every nft table of the netns is forgotten; the next read is a baseline.
    r.feed(&[Event::RuleTable(Box::new(crate::event::RuleTable {
        ts_ns: 7 * MS,
        netns: NS,
        family: "nft".into(),
        table: "*".into(),
        after_pid: 100,
        skipped: "too large to diff".into(),
        chains: Vec::new(),
        more: false,
    }))]);
    assert_eq!(changes(&r)[3].skipped.as_deref(), Some("too large to diff"));
    r.feed(&nft_read(
        8 * MS,
        NS,
        100,
        &[("nft ip", "filter", kp2), ("nft inet", "firewalld", fw)],
    ));
    assert_eq!(changes(&r).len(), 4, "{:?}", changes(&r));
}

/// Refusal counts whose tick was timed before the counters were read (builds before this
/// one took the time before reading the ring, which can take hundreds of milliseconds) hold
/// refusals of a hold that started after that time: the kernel's tag still ties them to it.
#[test]
fn refusal_counts_tie_to_a_hold_that_started_after_their_tick() {
    use crate::decode::{RefusalCount, RefusalCounts};
    let counts = |ts_ns: u64, count: u64| {
        Event::RefusalCounts(RefusalCounts {
            ts_ns,
            interval_ns: S,
            counts: vec![RefusalCount {
                hold_start_ns: 2 * S,
                netns: 7,
                kind: xtlock_common::REFUSAL_ICMP_UNREACH,
                detail: 3,
                addr: "10.96.0.15".parse().ok(),
                port: 8080,
                count,
            }],
            overflow: 0,
            reset_reasons: vec![],
        })
    };
    let mut r = Run::new();
    r.feed(&node())
        .feed(&spawn(10, 100, 200, "kube-proxy", RESTORE))
        .feed(&[
            acq(2 * S, 200, "iptables-restor", 0xA),
            counts(2 * S - 400 * MS, 40),
            rel(3 * S, 200, "iptables-restor", 0xA),
            counts(4 * S, 2),
        ]);
    let facts: Vec<&HoldRefusalsFact> = r
        .out
        .iter()
        .filter_map(|o| match o {
            Output::HoldRefusals(h) => Some(h),
            _ => None,
        })
        .collect();
    assert_eq!(facts.len(), 1, "{:?}", r.out);
    assert_eq!((facts[0].start_ns, facts[0].refused), (2 * S, 42));
    let tied: u64 = r
        .out
        .iter()
        .filter_map(|o| match o {
            Output::RefusalCount(f) if f.hold.is_some() => Some(f.count),
            _ => None,
        })
        .sum();
    assert_eq!(tied, 42);
}
