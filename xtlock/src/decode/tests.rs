use super::*;

#[test]
fn conntrack_fail_decodes() {
    let mut saddr = [0u8; 16];
    saddr[..4].copy_from_slice(&[10, 0, 0, 9]);
    let mut daddr = [0u8; 16];
    daddr[..4].copy_from_slice(&[10, 96, 0, 10]);
    let e = common::ConntrackFailEvent {
        hdr: header(common::EventKind::ConntrackFail, 5, 5, 1000),
        netns: 7,
        what: common::CT_FAIL_TABLE_FULL,
        l4proto: 17,
        family: common::DROP_FAMILY_INET,
        _pad0: 0,
        saddr,
        daddr,
        sport: 40000,
        dport: 53,
        _pad: 0,
        comm: *b"dig\0\0\0\0\0\0\0\0\0\0\0\0\0",
    };
    let Event::ConntrackFail(c) = decode(&bytes(&e)).unwrap() else {
        panic!("not a conntrack failure");
    };
    assert_eq!(c.what, CtFailKind::TableFull);
    assert_eq!(c.saddr, Some("10.0.0.9".parse().unwrap()));
    assert_eq!(c.daddr, Some("10.96.0.10".parse().unwrap()));
    assert_eq!((c.sport, c.dport, c.netns, c.l4proto), (40000, 53, 7, 17));
    assert_eq!(c.comm.as_str(), "dig");
    // Cut short: an error, not a panic.
    assert!(decode(&bytes(&e)[..60]).is_err());
}

/// A sampled refusal: its tuple when the packet was read; the destination alone (no
/// made-up source) when it was not.
#[test]
fn refusal_sample_decodes() {
    let mut saddr = [0u8; 16];
    saddr[..4].copy_from_slice(&[10, 0, 0, 9]);
    let mut daddr = [0u8; 16];
    daddr[..4].copy_from_slice(&[10, 96, 0, 15]);
    let mut e = common::RefusalEvent {
        hdr: header(common::EventKind::Refusal, 5, 5, 1000),
        hold_start_ns: 900,
        netns: 7,
        detail: 3,
        kind: common::REFUSAL_ICMP_UNREACH,
        family: common::DROP_FAMILY_INET,
        l4proto: 6,
        _pad: 0,
        sport: 40312,
        dport: 80,
        saddr,
        daddr,
    };
    let Event::Refusal(r) = decode(&bytes(&e)).unwrap() else {
        panic!("not a refusal");
    };
    assert_eq!(r.saddr, Some("10.0.0.9".parse().unwrap()));
    assert_eq!(r.daddr, Some("10.96.0.15".parse().unwrap()));
    assert_eq!(
        (r.sport, r.dport, r.netns, r.hold_start_ns),
        (40312, 80, 7, 900)
    );
    e.l4proto = 0;
    let Event::Refusal(r) = decode(&bytes(&e)).unwrap() else {
        panic!("not a refusal");
    };
    assert_eq!((r.saddr, r.dport), (None, 80));
    assert!(decode(&bytes(&e)[..60]).is_err());
}

/// An event header: kind, process, thread and time.
fn header(kind: common::EventKind, tgid: u32, tid: u32, ts_ns: u64) -> common::EventHeader {
    common::EventHeader {
        kind: kind as u32,
        tgid,
        tid,
        _pad: 0,
        ts_ns,
    }
}

fn bytes<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: T is a POD repr(C) event struct; we only read its bytes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

fn lock(fl_type: u8, ret: i32, flags: u32) -> common::LockEvent {
    common::LockEvent {
        hdr: header(common::EventKind::Lock, 10, 11, 1234),
        owner: 0xffff_8888_0000_1000,
        ino: 77,
        dev: 5,
        ret,
        fl_flags: flags,
        fl_type,
        _pad: [0; 3],
        comm: Comm::new("iptables").0,
    }
}

#[test]
fn lock_ops() {
    let cases = [
        (
            lock(common::F_WRLCK, 0, 130),
            LockOp::Acquired { exclusive: true },
        ),
        (
            lock(common::F_RDLCK, 0, 130),
            LockOp::Acquired { exclusive: false },
        ),
        (lock(common::F_WRLCK, 1, 130), LockOp::Deferred),
        (lock(common::F_WRLCK, -11, 2), LockOp::Failed { errno: 11 }),
        (lock(common::F_UNLCK, 0, 2), LockOp::Released),
    ];
    for (raw, op) in cases {
        let Event::Lock(e) = decode(&bytes(&raw)).unwrap() else {
            panic!("not a lock event")
        };
        assert_eq!(e.op, op);
        assert_eq!(e.comm.as_str(), "iptables");
        assert_eq!(
            (e.tgid, e.tid, e.ts_ns, e.ino, e.dev),
            (10, 11, 1234, 77, 5)
        );
    }
    let Event::Lock(e) = decode(&bytes(&lock(common::F_WRLCK, -11, 2))).unwrap() else {
        panic!()
    };
    assert!(e.nonblocking);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    assert_eq!(decode(&[]), Err(DecodeError::TooShort { len: 0 }));
    let mut b = bytes(&lock(common::F_WRLCK, 0, 0));
    b.truncate(40);
    assert!(matches!(decode(&b), Err(DecodeError::Truncated { .. })));
    let mut b = bytes(&lock(common::F_WRLCK, 0, 0));
    b[0] = 200;
    assert_eq!(decode(&b), Err(DecodeError::UnknownKind { kind: 200 }));
    for n in 0..b.len() {
        let _ = decode(&b[..n]);
    }
}

#[test]
fn drop_samples() {
    let mut e = common::DropEvent {
        hdr: header(common::EventKind::Drop, 7, 8, 99),
        location: 0xffff_ffff_8100_0000,
        netns: 4026531840,
        ifindex: 3,
        reason: 12,
        ethertype: 0x0800,
        l4proto: 17,
        family: common::DROP_FAMILY_INET,
        saddr: [0; 16],
        daddr: [0; 16],
        sport: 40000,
        dport: 53,
        _pad: 0,
    };
    e.saddr[..4].copy_from_slice(&[10, 0, 0, 1]);
    e.daddr[..4].copy_from_slice(&[10, 0, 0, 2]);
    let Event::Drop(d) = decode(&bytes(&e)).unwrap() else {
        panic!()
    };
    assert_eq!(d.saddr, Some("10.0.0.1".parse().unwrap()));
    assert_eq!(d.daddr, Some("10.0.0.2".parse().unwrap()));
    assert_eq!((d.sport, d.dport, d.l4proto, d.reason), (40000, 53, 17, 12));
    assert_eq!((d.netns, d.ifindex, d.ts_ns), (4026531840, 3, 99));
    e.family = common::DROP_FAMILY_INET6;
    e.daddr = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
    let Event::Drop(d) = decode(&bytes(&e)).unwrap() else {
        panic!()
    };
    assert_eq!(d.daddr, Some("fd00::2".parse().unwrap()));
    e.family = common::DROP_FAMILY_NONE;
    let Event::Drop(d) = decode(&bytes(&e)).unwrap() else {
        panic!()
    };
    assert_eq!((d.saddr, d.daddr), (None, None));
    let b = bytes(&e);
    assert!(matches!(
        decode(&b[..60]),
        Err(DecodeError::Truncated { .. })
    ));
}

/// An exec event with empty strings.
fn exec(argc: u32, comm: &str) -> common::ExecEvent {
    common::ExecEvent {
        hdr: common::EventHeader {
            kind: common::EventKind::Exec as u32,
            ..Default::default()
        },
        filename: [0; common::FILENAME_LEN],
        args: [[0; common::ARG_LEN]; common::ARGV_SLOTS],
        argc,
        args_truncated: 0,
        comm: Comm::new(comm).0,
        netns: 0,
        _pad: 0,
    }
}

/// The exec's network namespace, as the kernel saw it; an exec record from before it was
/// appended (688 bytes) decodes with the namespace unknown.
#[test]
fn exec_netns_and_older_records() {
    let mut e = exec(1, "nft");
    e.netns = 4026532246;
    let b = bytes(&e);
    let Event::Exec(d) = decode(&b).unwrap() else {
        panic!()
    };
    assert_eq!(d.netns, 4026532246);
    let Event::Exec(old) = decode(&b[..common::EXEC_V1_LEN]).unwrap() else {
        panic!()
    };
    assert_eq!((old.netns, old.comm), (0, d.comm));
    assert!(decode(&b[..common::EXEC_V1_LEN - 1]).is_err());
}

#[test]
fn exec_argv() {
    let mut e = exec(3, "iptables-restor");
    e.filename[..15].copy_from_slice(b"/usr/sbin/ipt-r");
    e.args[0][..16].copy_from_slice(b"iptables-restore");
    e.args[1][..2].copy_from_slice(b"-w");
    e.args[2][..1].copy_from_slice(b"5");
    let Event::Exec(d) = decode(&bytes(&e)).unwrap() else {
        panic!()
    };
    assert!(d.argv.iter().eq(["iptables-restore", "-w", "5"]));
    assert_eq!(d.filename, "/usr/sbin/ipt-r");
    assert_eq!(d.argv.join_shared(" ..."), "iptables-restore -w 5 ...");
    assert_eq!(
        serde_json::to_string(&d.argv).unwrap(),
        r#"["iptables-restore","-w","5"]"#
    );
}

#[test]
fn nul_pos_matches_a_plain_search() {
    let mut b = [b'a'; 40];
    for len in 0..=b.len() {
        for nul in 0..=len {
            b.fill(b'a');
            // 0x80 bytes: not taken for zeros by the word trick.
            b[1] = 0x80;
            if nul < len {
                b[nul] = 0;
            }
            let want = b[..len].iter().position(|&c| c == 0).unwrap_or(len);
            assert_eq!(nul_pos(&b[..len]), want, "len {len}, nul {nul}");
        }
    }
    assert_eq!(nul_pos(&[1, 0, 0, 0, 0, 0, 0, 0, 0]), 1);
}

#[test]
fn exec_strings_not_utf8_are_lossy() {
    let mut e = exec(9, "sh");
    e.args_truncated = 1;
    e.filename[..4].copy_from_slice(&[b'/', b'a', 0xff, b'b']);
    e.args[0][..3].copy_from_slice(&[b'x', 0xc3, b'y']);
    e.args[1] = [b'z'; common::ARG_LEN];
    e.args[7][..2].copy_from_slice("é".as_bytes());
    let Event::Exec(d) = decode(&bytes(&e)).unwrap() else {
        panic!()
    };
    assert_eq!(d.filename, "/a\u{fffd}b");
    let z = "z".repeat(common::ARG_LEN);
    let want = ["x\u{fffd}y", &z, "", "", "", "", "", "é"];
    assert!(d.argv.iter().eq(want), "{:?}", d.argv);
    assert_eq!(d.argv.len(), common::ARGV_SLOTS);
    assert!(d.argv_truncated);
    assert_eq!(d.comm.as_str(), "sh");
    // All slots full, no NUL: longer than the joining buffer, same text.
    e.args = [[b'q'; common::ARG_LEN]; common::ARGV_SLOTS];
    let Event::Exec(d) = decode(&bytes(&e)).unwrap() else {
        panic!()
    };
    assert!(d.argv.iter().all(|a| a == "q".repeat(common::ARG_LEN)));
    assert_eq!(d.argv.len(), common::ARGV_SLOTS);
    e.argc = 2;
    let Event::Exec(d) = decode(&bytes(&e)).unwrap() else {
        panic!()
    };
    assert_eq!(d.argv.len(), 2);
}

#[test]
fn hot_events_stay_small() {
    // Every event is moved through a few layers (reader, iterator, analysis): rare big
    // kinds are boxed so the common ones move cheaply.
    assert!(std::mem::size_of::<Event>() <= 88);
    assert!(std::mem::size_of::<Option<Result<Event, crate::capture::CaptureError>>>() <= 88);
}

#[test]
fn argv_edges() {
    let none = Argv::default();
    assert_eq!((none.len(), none.iter().count()), (0, 0));
    assert_eq!(none.join_shared(" ..."), "");
    let one_empty = Argv::new([""]);
    assert!(one_empty.iter().eq([""]));
    assert_eq!(one_empty.join_shared(" ..."), "");
    let two_empty = Argv::new(["", ""]);
    assert_eq!(two_empty.join(), " ");
    assert_eq!(two_empty.join_shared(" ..."), "  ...");
    let long = Argv::new(std::iter::repeat_n("x".repeat(100), 20));
    assert_eq!(long.join_shared("").len(), 20 * 101 - 1);
}

/// A table replace with the head of its argument; the same record as versions before the
/// head wrote it (56 bytes) still decodes, without one.
#[test]
fn table_replace_with_and_without_its_head() {
    let mut table = [0u8; common::XT_TABLE_MAXNAMELEN];
    table[..3].copy_from_slice(b"nat");
    let e = common::TableReplaceEvent {
        hdr: header(common::EventKind::TableReplace, 5, 6, 2000),
        enter_ns: 1000,
        ret: 0,
        level: common::SOL_IP,
        optname: common::XT_SO_SET_REPLACE,
        optlen: 4096,
        _pad: 0,
        table,
        num_entries: 107,
        size: 21112,
        head_ok: 1,
        dir: 0,
        netns: 4026531840,
        _pad2: 0,
    };
    let b = bytes(&e);
    let Event::TableReplace(t) = decode(&b).unwrap() else {
        panic!("not a table replace");
    };
    let head = t.head.as_ref().expect("a head");
    assert_eq!(
        (head.name(), head.entries, head.bytes),
        ("nat".into(), 107, 21112)
    );
    assert_eq!(
        (t.enter_ns, t.optlen, t.tid, t.read, t.netns),
        (1000, 4096, 6, false, 4026531840)
    );
    // A record from before the netns: the head, netns unknown.
    let Event::TableReplace(v2) = decode(&b[..common::TABLE_REPLACE_V2_LEN]).unwrap() else {
        panic!("not a table replace");
    };
    assert_eq!((v2.head, v2.netns), (t.head.clone(), 0));
    let Event::TableReplace(old) = decode(&b[..common::TABLE_REPLACE_V1_LEN]).unwrap() else {
        panic!("not a table replace");
    };
    assert_eq!(
        (old.head, old.head_recorded, old.enter_ns, old.read),
        (None, false, 1000, false)
    );
    // A table read (getsockopt).
    let r = common::TableReplaceEvent {
        dir: common::SOCKOPT_GET,
        ..e
    };
    let Event::TableReplace(t) = decode(&bytes(&r)).unwrap() else {
        panic!("not a table read");
    };
    assert!(t.read);
    assert!(decode(&b[..common::TABLE_REPLACE_V1_LEN - 1]).is_err());
    // Unread head: none.
    let e = common::TableReplaceEvent { head_ok: 0, ..e };
    let Event::TableReplace(t) = decode(&bytes(&e)).unwrap() else {
        panic!("not a table replace");
    };
    assert_eq!(t.head, None);
}

/// An nf_tables commit with its batch's counts; the 56-byte record of versions before the
/// counts still decodes, as "not counted"; so does a record saying the batch was not walked.
#[test]
fn nft_commit_with_and_without_its_batch() {
    let e = common::NftCommitEvent {
        hdr: header(common::EventKind::NftCommit, 5, 6, 2000),
        enter_ns: 1000,
        netns: 4026531840,
        batch: common::NFT_BATCH_PARTIAL,
        comm: Comm::new("nft").0,
        added: [0, 1, 1023, 0, 0, 0, 0, 0],
        deleted: [0; common::NFT_KINDS],
    };
    let b = bytes(&e);
    let Event::NftCommit(c) = decode(&b).unwrap() else {
        panic!("not a commit");
    };
    let batch = c.batch.expect("counted");
    assert_eq!((batch.status, batch.changes()), ("partial", 1024));
    assert_eq!(
        (c.enter_ns, c.netns, c.comm.as_str().as_ref()),
        (1000, 4026531840, "nft")
    );
    let Event::NftCommit(old) = decode(&b[..common::NFT_COMMIT_V1_LEN]).unwrap() else {
        panic!("not a commit");
    };
    assert_eq!(
        (old.batch, old.enter_ns, old.netns),
        (None, 1000, 4026531840)
    );
    assert!(decode(&b[..common::NFT_COMMIT_V1_LEN - 1]).is_err());
    let none = common::NftCommitEvent {
        batch: common::NFT_BATCH_NONE,
        ..e
    };
    let Event::NftCommit(c) = decode(&bytes(&none)).unwrap() else {
        panic!("not a commit");
    };
    assert_eq!(c.batch, None);
}

/// An nf_tables mutex wait: which mutex, the holder when it began (none when free), and a
/// record cut short is an error; a batch's sendmsg() likewise.
#[test]
fn nft_mutex_waits_and_sends() {
    let e = common::NftMutexWaitEvent {
        hdr: header(common::EventKind::NftMutexWait, 7, 7, 9000),
        start_ns: 1000,
        lock: 0xffff_8881_fa49_3670,
        netns: 4026532177,
        mutex: common::NFT_MUTEX_NFNL,
        ret: 0,
        flags: common::LCB_F_MUTEX | common::LCB_F_SPIN,
        holder_tid: 8,
        holder_tgid: 8,
        comm: Comm::new("nft").0,
        holder_comm: Comm::new("kube-proxy").0,
    };
    let b = bytes(&e);
    let Event::NftMutexWait(w) = decode(&b).unwrap() else {
        panic!("not a wait");
    };
    assert_eq!((w.start_ns, w.ts_ns, w.tid), (1000, 9000, 7));
    assert_eq!((w.mutex, w.holder), (NftMutex::Nfnl, Some((8, 8))));
    assert_eq!(w.holder_comm.as_str().as_ref(), "kube-proxy");
    let free = common::NftMutexWaitEvent {
        mutex: common::NFT_MUTEX_COMMIT,
        holder_tid: 0,
        holder_tgid: 0,
        ..e
    };
    let Event::NftMutexWait(w) = decode(&bytes(&free)).unwrap() else {
        panic!("not a wait");
    };
    assert_eq!((w.mutex, w.holder), (NftMutex::Commit, None));
    assert!(decode(&b[..b.len() - 1]).is_err());
    let s = common::NftSendEvent {
        hdr: header(common::EventKind::NftSend, 7, 7, 9000),
        enter_ns: 500,
        netns: 4026532177,
        ret: 4096,
        comm: Comm::new("nft").0,
        batch: common::NFT_BATCH_COMPLETE,
        _pad: 0,
        added: [0, 0, 300, 0, 0, 0, 0, 0],
        deleted: [0, 0, 0, 0, 2, 0, 0, 0],
    };
    let b = bytes(&s);
    let Event::NftSend(e) = decode(&b).unwrap() else {
        panic!("not a send");
    };
    assert_eq!(
        (e.enter_ns, e.ts_ns, e.netns, e.ret),
        (500, 9000, 4026532177, 4096)
    );
    let batch = e.batch.expect("counted");
    assert_eq!((batch.status, batch.changes()), ("complete", 302));
    // A record of the version before the counts: the same call, not counted.
    let Event::NftSend(old) = decode(&b[..common::NFT_SEND_V1_LEN]).unwrap() else {
        panic!("not a send");
    };
    assert_eq!((old.batch, old.enter_ns, old.ret), (None, 500, 4096));
    assert!(decode(&b[..common::NFT_SEND_V1_LEN - 1]).is_err());
    let none = common::NftSendEvent {
        batch: common::NFT_BATCH_NONE,
        ..s
    };
    let Event::NftSend(e) = decode(&bytes(&none)).unwrap() else {
        panic!("not a send");
    };
    assert_eq!(e.batch, None);
}

/// Every event of one record.
fn all(d: &mut Decoder, b: &[u8]) -> Vec<Event> {
    let mut v: Vec<Event> = d.decode(b).unwrap().into_iter().collect();
    v.extend(d.pending());
    v
}

fn hold_record(take: common::LockEvent, ts: u64, tid: u32, comm: &str) -> common::HoldEvent {
    common::HoldEvent {
        hdr: header(common::EventKind::Hold, take.hdr.tgid, tid, ts),
        take,
        ret: 0,
        fl_flags: 2,
        comm: Comm::new(comm).0,
    }
}

/// A `Hold` record reads as the two `Lock` records it stands for.
#[test]
fn a_hold_record_is_its_take_and_release() {
    let take = lock(common::F_WRLCK, 0, 130);
    let release = common::LockEvent {
        hdr: header(common::EventKind::Lock, 10, 12, 5000),
        fl_type: common::F_UNLCK,
        fl_flags: 2,
        comm: Comm::new("iptables-child").0,
        ..take
    };
    let pair = all(
        &mut Decoder::default(),
        &bytes(&hold_record(take, 5000, 12, "iptables-child")),
    );
    let mut apart = Decoder::default();
    let want: Vec<Event> = [take, release]
        .iter()
        .flat_map(|r| all(&mut apart, &bytes(r)))
        .collect();
    assert_eq!(pair, want);
    assert_eq!(pair.len(), 2);
    // Without a Decoder it is a clear error, not half of it.
    assert_eq!(
        decode(&bytes(&hold_record(take, 5000, 12, "x"))),
        Err(DecodeError::TwoEvents)
    );
    // Cut short: an error that says so.
    let b = bytes(&hold_record(take, 5000, 12, "x"));
    assert!(matches!(
        Decoder::default().decode(&b[..b.len() - 1]),
        Err(DecodeError::Truncated { .. })
    ));
}

/// A take the kernel kept can arrive twice (two CPUs sent it, or userspace read it from
/// the map first), or again later after a race on who sent it: once is kept, releases and
/// other owners' takes are not touched.
#[test]
fn a_take_sent_twice_is_read_once() {
    let take = lock(common::F_WRLCK, 0, 130);
    let mut d = Decoder::default();
    let n = |d: &mut Decoder, b: Vec<u8>| all(d, &b).len();
    assert_eq!(n(&mut d, bytes(&take)), 1);
    assert_eq!(n(&mut d, bytes(&take)), 0);
    // Its Hold record: the release alone.
    let evs = all(&mut d, &bytes(&hold_record(take, 5000, 11, "iptables")));
    assert!(matches!(&evs[..], [Event::Lock(l)] if l.op == LockOp::Released));
    // An older take of that owner, sent again later: dropped.
    let older = common::LockEvent {
        hdr: header(common::EventKind::Lock, 10, 11, 1000),
        ..take
    };
    assert_eq!(n(&mut d, bytes(&older)), 0);
    // The owner's next take, another owner's take at the same time, a shared take: kept.
    let next = common::LockEvent {
        hdr: header(common::EventKind::Lock, 10, 11, 6000),
        ..take
    };
    assert_eq!(n(&mut d, bytes(&next)), 1);
    let other = common::LockEvent {
        owner: take.owner + 64,
        ..take
    };
    assert_eq!(n(&mut d, bytes(&other)), 1);
    let shared = lock(common::F_RDLCK, 0, 130);
    assert_eq!(n(&mut d, bytes(&shared)), 1);
    assert_eq!(n(&mut d, bytes(&shared)), 1);
}
