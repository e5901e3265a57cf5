use super::*;

pub fn fork(ts: u64, parent: u32, child: u32, comm: &str) -> Event {
    Event::Fork(ForkEvent {
        ts_ns: ts,
        parent_tgid: parent,
        parent_tid: parent,
        child_tid: child,
        comm: Comm::new(comm),
    })
}

pub fn exec(ts: u64, pid: u32, filename: &str, argv: &[&str]) -> Event {
    let comm = basename(filename);
    Event::Exec(ExecEvent {
        ts_ns: ts,
        tgid: pid,
        tid: pid,
        comm: Comm::new(comm),
        filename: filename.into(),
        argv: Argv::new(argv),
        argv_truncated: false,
        netns: 0,
    })
}

pub fn exit(ts: u64, pid: u32, comm: &str, code: Option<i32>) -> Event {
    Event::Exit(ExitEvent {
        ts_ns: ts,
        tgid: pid,
        tid: pid,
        comm: Comm::new(comm),
        exit_code: code,
    })
}

pub fn seed(ts: u64, pid: u32, ppid: u32, comm: &str, cgroup: Option<&str>) -> Event {
    Event::Proc(ProcInfo {
        ts_ns: ts,
        pid,
        ppid,
        comm: Comm::new(comm),
        argv: vec![comm.to_string()],
        cgroup: cgroup.map(str::to_string),
        exe: None,
    })
}

fn comms(t: &ProcTable, pid: u32) -> Vec<String> {
    t.ancestors(pid).map(|p| p.comm.to_string()).collect()
}

#[test]
fn fork_exec_exit() {
    let mut t = ProcTable::new();
    t.apply(&seed(0, 1, 0, "systemd", Some("0::/init.scope")));
    t.apply(&seed(0, 100, 1, "kube-proxy", Some("0::/kubepods/x")));
    t.apply(&fork(10, 100, 200, "kube-proxy"));
    let c = t.get(200).unwrap();
    assert_eq!(c.ppid, 100);
    assert_eq!(c.comm.as_str(), "kube-proxy");
    assert_eq!(
        c.cgroup.as_ref().map(|c| c.path.as_str()),
        Some("0::/kubepods/x")
    );
    t.apply(&exec(
        11,
        200,
        "/usr/sbin/iptables-restore",
        &["iptables-restore", "-w", "5"],
    ));
    let c = t.get(200).unwrap();
    assert_eq!(c.comm.as_str(), "iptables-restor");
    assert_eq!(c.cmdline(), "iptables-restore -w 5");
    assert_eq!(c.exe_name(), "iptables-restore");
    assert_eq!(comms(&t, 200), ["iptables-restor", "kube-proxy", "systemd"]);
    t.apply(&exit(20, 200, "iptables-restor", Some(0)));
    let c = t.get(200).unwrap();
    assert_eq!(
        c.exited,
        Some(ExitInfo {
            ts_ns: 20,
            code: Some(0)
        })
    );
    // Still walkable after the exit.
    assert_eq!(comms(&t, 200).len(), 3);
}

#[test]
fn threads_come_and_go() {
    let mut t = ProcTable::new();
    t.apply(&seed(0, 100, 1, "calico-node", None));
    t.apply(&fork(5, 100, 101, "calico-node"));
    assert!(t.get(101).is_some());
    t.apply(&Event::Exit(ExitEvent {
        ts_ns: 6,
        tgid: 100,
        tid: 101,
        comm: Comm::new("calico-node"),
        exit_code: None,
    }));
    assert!(t.get(101).is_none());
    assert!(t.get(100).unwrap().is_alive());
}

#[test]
fn pid_reuse_replaces_dead_entry() {
    let mut t = ProcTable::new();
    t.apply(&seed(0, 100, 1, "kube-proxy", None));
    t.apply(&seed(0, 300, 1, "calico-node", None));
    t.apply(&fork(10, 100, 200, "kube-proxy"));
    let g1 = t.get(200).unwrap().generation;
    t.apply(&exit(20, 200, "kube-proxy", Some(0)));
    t.apply(&fork(30, 300, 200, "calico-node"));
    let p = t.get(200).unwrap();
    assert!(p.is_alive());
    assert_ne!(p.generation, g1);
    assert_eq!(p.ppid, 300);
    assert_eq!(comms(&t, 200), ["calico-node", "calico-node"]);
    // An exec for a dead pid is a new process too.
    t.apply(&exit(40, 200, "calico-node", Some(0)));
    t.apply(&exec(50, 200, "/usr/sbin/iptables", &["iptables"]));
    let p = t.get(200).unwrap();
    assert!(p.is_alive());
    assert_eq!(p.ppid, 0);
}

#[test]
fn dead_entries_are_pruned_by_age_and_count() {
    let mut t = ProcTable::with_limits(3, 1_000);
    t.apply(&seed(0, 1, 0, "init", None));
    for pid in 10..20 {
        t.apply(&fork(pid as u64, 1, pid, "x"));
        t.apply(&exit(pid as u64, pid, "x", Some(0)));
    }
    assert!(t.dead_count() <= 3, "{}", t.dead_count());
    assert!(t.get(19).is_some());
    t.prune(10_000);
    assert_eq!(t.dead_count(), 0);
    assert!(t.get(1).is_some());
}

#[test]
fn pid_index_agrees_with_a_hash_map() {
    let mut idx = PidIndex::default();
    let mut map = std::collections::HashMap::new();
    let mut x: u64 = 12345;
    for n in 0..200_000u32 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Few distinct pids, so that removals hit and probe runs collide.
        let pid = ((x >> 33) % 3000) as u32 | if n.is_multiple_of(7) { u32::MAX - 5 } else { 0 };
        if (x >> 20).is_multiple_of(3) {
            assert_eq!(idx.remove(pid), map.remove(&pid));
        } else {
            idx.insert(pid, n);
            map.insert(pid, n);
        }
        assert_eq!(idx.get(pid), map.get(&pid).copied());
        assert_eq!(idx.len(), map.len());
    }
    for pid in 0..3000 {
        assert_eq!(idx.get(pid), map.get(&pid).copied());
    }
}

#[test]
fn chain_walk_survives_cycles_and_reuse() {
    let mut t = ProcTable::new();
    // A cycle can only come from garbage, but must not hang.
    t.apply(&seed(0, 5, 6, "a", None));
    t.apply(&seed(0, 6, 5, "b", None));
    assert_eq!(comms(&t, 5), ["a", "b"]);
    // A parent entry younger than its child is a reused pid: stop there.
    t.apply(&seed(50, 7, 8, "child", None));
    t.apply(&fork(100, 1, 8, "newcomer"));
    assert_eq!(comms(&t, 7), ["child"]);
    // Long chains are cut.
    for pid in 1000..1200u32 {
        t.apply(&seed(0, pid, pid + 1, "deep", None));
    }
    assert_eq!(t.ancestors(1000).count(), MAX_CHAIN);
}
