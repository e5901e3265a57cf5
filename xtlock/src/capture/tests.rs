//! Capture round trips, damage and truncation at every byte, and the size of a lock event.

use std::io::{self, Write};

use proptest::prelude::*;
use xtlock_common as common;

use super::{
    format::{self, BlockHeader, BLOCK_HEADER_LEN},
    CaptureError, CaptureHeader, CaptureLock, CaptureProbe, CaptureReader, CaptureWriter, Damage,
    DamageSummary, DamagedRegion, OwnedRecord, Trailer,
};
use crate::decode::{self, Comm, Event, ProcInfo};

fn as_bytes<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: only used on the `#[repr(C)]` event structs of xtlock-common, which are made of
    // integers and byte arrays with explicit padding fields: every byte is initialised.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

fn hdr(kind: common::EventKind, tgid: u32, ts_ns: u64) -> common::EventHeader {
    common::EventHeader {
        kind: kind as u32,
        tgid,
        tid: tgid,
        _pad: 0,
        ts_ns,
    }
}

fn lock_event(ts_ns: u64, tgid: u32, fl_type: u8, ret: i32) -> common::LockEvent {
    common::LockEvent {
        hdr: hdr(common::EventKind::Lock, tgid, ts_ns),
        owner: 0xffff_9a3c_4e21_7b00,
        ino: 1_048_621,
        dev: 25,
        ret,
        fl_flags: 130,
        fl_type,
        _pad: [0; 3],
        comm: Comm::new("iptables").0,
    }
}

fn sample_header() -> CaptureHeader {
    CaptureHeader {
        xtlock_version: "0.1.0".into(),
        hostname: "node-a".into(),
        kernel_release: "6.1.0-test".into(),
        boot_to_wall_offset_ns: 1_700_000_000_000_000_000,
        started_wall_ns: 1_700_000_123_000_000_000,
        locks: vec![CaptureLock {
            path: "/run/xtables.lock".into(),
            dev: 25,
            ino: 1_048_621,
        }],
        probes: vec![
            CaptureProbe {
                program: "flock_lock_inode".into(),
                attach: "filelock/flock_lock_inode".into(),
                error: None,
            },
            CaptureProbe {
                program: "skb_drop".into(),
                attach: "skb/kfree_skb".into(),
                error: Some("no such tracepoint".into()),
            },
        ],
        extra: serde_json::json!({ "ring_bytes": 1 << 20 }),
    }
}

fn proc_info(pid: u32) -> ProcInfo {
    ProcInfo {
        ts_ns: 5_000 + u64::from(pid),
        pid,
        ppid: 1,
        comm: Comm::new("kube-proxy"),
        argv: vec!["/usr/local/bin/kube-proxy".into(), "--v=2".into()],
        cgroup: Some("/kubepods.slice/kubepods-besteffort.slice/cri-containerd-1.scope".into()),
        exe: None,
    }
}

#[derive(Clone, Debug)]
enum Op {
    Kernel(Vec<u8>),
    Proc(ProcInfo),
    Lost(u64, u64),
    Flush,
}

/// Writes `ops`; returns the file and the records a reader must return (trailer last).
fn write_ops(header: &CaptureHeader, ops: &[Op], finish: bool) -> (Vec<u8>, Vec<OwnedRecord>) {
    let mut buf = Vec::new();
    let mut want = Vec::new();
    let mut w = CaptureWriter::new(&mut buf, header).unwrap();
    let mut t = Trailer::default();
    for op in ops {
        match op {
            Op::Kernel(b) => {
                w.write_kernel(b).unwrap();
                t.kernel_events += 1;
                want.push(OwnedRecord::Kernel(b.clone()));
            }
            Op::Proc(p) => {
                w.write_proc(p).unwrap();
                t.proc_records += 1;
                want.push(OwnedRecord::Proc(p.clone()));
            }
            Op::Lost(ts_ns, count) => {
                w.write_lost(*ts_ns, *count).unwrap();
                t.lost_records += 1;
                t.lost_events = t.lost_events.saturating_add(*count);
                want.push(OwnedRecord::Lost {
                    ts_ns: *ts_ns,
                    count: *count,
                });
            }
            Op::Flush => w.flush_block().unwrap(),
        }
    }
    if finish {
        let stats = w.finish().unwrap();
        t.blocks = stats.blocks;
        assert_eq!(stats.kernel_events, t.kernel_events);
        want.push(OwnedRecord::End(t));
    } else {
        // As if killed: nothing pending reaches the file.
        std::mem::forget(w);
    }
    (buf, want)
}

/// Everything a reader returns: header (or the open error), records, the damage skipped, and
/// the error that ended reading, if any.
struct ReadBack {
    header: Option<CaptureHeader>,
    records: Vec<OwnedRecord>,
    skipped: Vec<DamagedRegion>,
    damage: Option<DamageSummary>,
    error: Option<CaptureError>,
}

fn read_all(bytes: &[u8]) -> ReadBack {
    let (header, mut r) = match CaptureReader::new(bytes) {
        Ok(x) => x,
        Err(e) => {
            return ReadBack {
                header: None,
                records: Vec::new(),
                skipped: Vec::new(),
                damage: None,
                error: Some(e),
            }
        }
    };
    let mut records = Vec::new();
    let mut skipped = Vec::new();
    let mut error = None;
    while let Some(rec) = r.next_owned() {
        match rec {
            Ok(rec) => {
                assert!(error.is_none(), "a record after {error:?}");
                records.push(rec);
            }
            Err(CaptureError::Skipped(region)) => {
                assert!(error.is_none(), "skipped damage after {error:?}");
                skipped.push(*region);
            }
            Err(e) => {
                assert!(error.is_none(), "a second error after {:?}", error);
                error = Some(e);
            }
        }
    }
    // The reader stays done.
    assert!(r.next_record().is_none());
    let damage = r.damage();
    // The summary names every place the records said was skipped, and only those.
    assert_eq!(
        damage.as_ref().map_or(&[][..], |d| &d.regions[..]),
        &skipped[..]
    );
    ReadBack {
        header: Some(header),
        records,
        skipped,
        damage,
        error,
    }
}

fn mixed_ops() -> Vec<Op> {
    let mut ops = vec![Op::Proc(proc_info(100)), Op::Proc(proc_info(101))];
    let mut ts = 1_000_000u64;
    for i in 0..40u32 {
        ts += 12_345;
        let ev = match i % 6 {
            0 => as_bytes(&lock_event(ts, 200 + i, common::F_WRLCK, 0)),
            1 => as_bytes(&common::FlockCallEvent {
                hdr: hdr(common::EventKind::FlockCall, 200 + i, ts),
                enter_ns: ts - 500,
                owner: 7,
                ino: 1_048_621,
                ret: -4,
                cmd: common::LOCK_EX,
                dev: 25,
            }),
            2 => {
                let mut e = common::ExecEvent {
                    hdr: hdr(common::EventKind::Exec, 200 + i, ts),
                    filename: [0; common::FILENAME_LEN],
                    args: [[0; common::ARG_LEN]; common::ARGV_SLOTS],
                    argc: 2,
                    args_truncated: 0,
                    comm: Comm::new("iptables").0,
                    netns: 0,
                    _pad: 0,
                };
                e.filename[..18].copy_from_slice(b"/usr/sbin/iptables");
                e.args[0][..8].copy_from_slice(b"iptables");
                e.args[1][..2].copy_from_slice(b"-L");
                as_bytes(&e)
            }
            3 => as_bytes(&common::ForkEvent {
                hdr: hdr(common::EventKind::Fork, 1, ts),
                child_tid: 200 + i,
                _pad: 0,
                comm: Comm::new("bash").0,
            }),
            4 => as_bytes(&common::ExitEvent {
                hdr: hdr(common::EventKind::Exit, 200 + i, ts),
                exit_code: 4,
                has_code: 1,
                comm: Comm::new("iptables").0,
            }),
            _ => as_bytes(&common::TableReplaceEvent {
                hdr: hdr(common::EventKind::TableReplace, 200 + i, ts),
                enter_ns: ts - 9,
                ret: 0,
                level: common::SOL_IP,
                optname: common::XT_SO_SET_REPLACE,
                optlen: 4096,
                _pad: 0,
                table: *b"nat\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0",
                num_entries: 40 + i,
                size: 4000,
                head_ok: 1,
                dir: 0,
                netns: 0,
                _pad2: 0,
            }),
        };
        ops.push(Op::Kernel(ev));
        if i % 11 == 10 {
            ops.push(Op::Lost(ts, u64::from(i)));
        }
        if i % 13 == 12 {
            ops.push(Op::Flush);
        }
    }
    ops
}

#[test]
fn round_trip_mixed() {
    let h = sample_header();
    let ops = mixed_ops();
    let (bytes, want) = write_ops(&h, &ops, true);
    let got = read_all(&bytes);
    assert_eq!(got.header.as_ref(), Some(&h));
    assert!(got.error.is_none(), "{:?}", got.error);
    assert_eq!(got.records, want);

    // events(): kernel records decoded exactly as `decode` does, proc and lost mapped.
    let (_, r) = CaptureReader::new(&bytes[..]).unwrap();
    let events: Vec<Event> = r.events().map(|e| e.unwrap()).collect();
    let want_events: Vec<Event> = want
        .iter()
        .filter_map(|r| match r {
            OwnedRecord::Kernel(b) => Some(decode::decode(b).unwrap()),
            OwnedRecord::Proc(p) => Some(Event::Proc(p.clone())),
            OwnedRecord::Lost { ts_ns, count } => Some(Event::Lost {
                ts_ns: *ts_ns,
                count: *count,
            }),
            OwnedRecord::Synthetic(e) => Some(e.clone()),
            OwnedRecord::End(_) => None,
        })
        .collect();
    assert_eq!(events, want_events);
    assert!(events
        .iter()
        .any(|e| matches!(e, Event::Exec(x) if x.argv.iter().eq(["iptables", "-L"]))));
}

#[test]
fn thousands_separators() {
    let t = super::thousands;
    assert_eq!(t(0), "0");
    assert_eq!(t(999), "999");
    assert_eq!(t(1234), "1,234");
    assert_eq!(t(123_456), "123,456");
    assert_eq!(t(1_234_567), "1,234,567");
}

#[test]
fn empty_capture_round_trips() {
    let (bytes, want) = write_ops(&CaptureHeader::default(), &[], true);
    let got = read_all(&bytes);
    assert!(got.error.is_none());
    assert_eq!(got.records, want);
    assert_eq!(
        want,
        [OwnedRecord::End(Trailer {
            blocks: 1,
            ..Default::default()
        })]
    );
}

#[test]
fn blocks_seal_at_target_size() {
    let mut buf = Vec::new();
    let mut w = CaptureWriter::new(&mut buf, &CaptureHeader::default()).unwrap();
    // Random-looking bytes so the payload does not compress away.
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut n = 0;
    while w.stats().blocks < 3 {
        let mut ev = [0u8; 72];
        for b in ev.iter_mut() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *b = (x >> 56) as u8;
        }
        w.write_kernel(&ev).unwrap();
        n += 1;
    }
    let s = w.stats();
    assert!(s.raw_bytes >= 3 * format::BLOCK_TARGET as u64);
    assert!(s.raw_bytes < 3 * (format::BLOCK_TARGET as u64 + 100));
    assert_eq!(s.kernel_events_on_disk, n);
    w.finish().unwrap();
    let got = read_all(&buf);
    assert!(got.error.is_none());
    assert_eq!(got.records.len() as u64, n + 1);
}

#[test]
fn killed_recorder_reads_as_cut_short() {
    let mut ops = mixed_ops();
    ops.push(Op::Flush);
    let flushed = ops.len();
    // Written after the last flush: lost with the process.
    ops.push(Op::Kernel(as_bytes(&lock_event(9, 9, common::F_UNLCK, 0))));
    let (bytes, want) = write_ops(&sample_header(), &ops, false);
    let got = read_all(&bytes);
    let want_prefix: Vec<_> = write_ops(&sample_header(), &ops[..flushed], false).1;
    assert_eq!(got.records, want_prefix);
    assert_eq!(want.len(), want_prefix.len() + 1);
    let e = got.error.unwrap();
    assert!(e.is_cut_short(), "{e}");
    assert!(
        matches!(e, CaptureError::CutShort { offset, partial: None, events: 40 } if offset == bytes.len() as u64),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("cut short") && msg.contains("40 events"),
        "{msg}"
    );
}

#[test]
fn dropped_writer_keeps_its_records() {
    let mut buf = Vec::new();
    let mut w = CaptureWriter::new(&mut buf, &CaptureHeader::default()).unwrap();
    w.write_lost(1, 2).unwrap();
    drop(w);
    let got = read_all(&buf);
    assert_eq!(got.records, [OwnedRecord::Lost { ts_ns: 1, count: 2 }]);
    assert!(got.error.unwrap().is_cut_short());
}

#[test]
fn create_and_open_a_file() {
    let dir = std::env::temp_dir().join(format!("xtlock-capture-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("a.xtcap");
    let h = sample_header();
    let mut w = CaptureWriter::create(&path, &h).unwrap();
    w.write_kernel(&as_bytes(&lock_event(1, 2, common::F_WRLCK, 0)))
        .unwrap();
    w.sync().unwrap();
    let stats = w.finish().unwrap();
    assert_eq!(stats.bytes_on_disk, std::fs::metadata(&path).unwrap().len());
    let (h2, mut r) = CaptureReader::open(&path).unwrap();
    assert_eq!(h2, h);
    assert!(matches!(r.next_record(), Some(Ok(super::Record::Kernel(b))) if b.len() == 72));
    assert!(matches!(r.next_record(), Some(Ok(super::Record::End(t))) if t.blocks == 2));
    assert!(r.next_record().is_none());
    assert_eq!(r.stats().bytes, stats.bytes_on_disk);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn not_a_capture_and_newer_versions() {
    for junk in [
        &b""[..],
        b"hello world, this is not a capture",
        b"\x7fELF\x02\x01\x01",
    ] {
        let e = read_all(junk).error.unwrap();
        assert_eq!(
            e.to_string(),
            "not an xtlock capture (no XTLKCAP magic at offset 0)"
        );
    }
    let (mut bytes, _) = write_ops(&CaptureHeader::default(), &[], true);
    bytes[8] = 3;
    let e = read_all(&bytes).error.unwrap();
    assert_eq!(
        e.to_string(),
        "capture format version 3 is newer than this xtlock supports (1): upgrade xtlock"
    );
    bytes[8] = 0;
    let e = read_all(&bytes).error.unwrap();
    assert!(matches!(
        e,
        CaptureError::Damaged {
            offset: 8,
            problem: Damage::VersionZero,
            ..
        }
    ));
}

#[test]
fn checksum_error_names_offset_and_what_was_skipped() {
    let h = CaptureHeader::default();
    let ev = as_bytes(&lock_event(1, 2, common::F_WRLCK, 0));
    let ops = [
        Op::Kernel(ev.clone()),
        Op::Kernel(ev.clone()),
        Op::Flush,
        Op::Kernel(ev.clone()),
        Op::Flush,
        Op::Kernel(ev),
    ];
    let (mut bytes, want) = write_ops(&h, &ops, true);
    let starts = block_starts(&bytes);
    let (second, third) = (starts[1], starts[2]);
    bytes[second + BLOCK_HEADER_LEN + 1] ^= 0x10;
    let got = read_all(&bytes);
    assert!(got.error.is_none(), "{:?}", got.error);
    // The second block's one event is missing, the third block's are read.
    assert_eq!(got.records.len(), 4);
    assert_eq!(got.records[..2], want[..2]);
    assert_eq!(got.records[2..], want[3..]);
    let msg = got.skipped[0].to_string();
    assert!(
        msg.starts_with(&format!(
            "offset {second} (block 1): payload checksum mismatch (expected 0x"
        )),
        "{msg}"
    );
    assert!(
        msg.ends_with(&format!(
            "; 1 block (1 record) skipped, reading went on at offset {third}"
        )),
        "{msg}"
    );
    assert_eq!(
        got.damage.unwrap().lines()[1],
        "the end-of-capture record's totals are short by what the damage took: 1 block, \
         1 kernel event not read"
    );
}

/// Offsets of the blocks of an undamaged capture, from their headers.
fn block_starts(bytes: &[u8]) -> Vec<usize> {
    let json_len = u32::from_le_bytes(bytes[10..14].try_into().unwrap()) as usize;
    let mut at = format::FILE_PREFIX_LEN + json_len + 4;
    let mut starts = Vec::new();
    while at < bytes.len() {
        starts.push(at);
        let stored = u32::from_le_bytes(bytes[at + 16..at + 20].try_into().unwrap()) as usize;
        at += BLOCK_HEADER_LEN + stored;
    }
    assert_eq!(at, bytes.len());
    starts
}

fn header_len(bytes: &[u8]) -> usize {
    block_starts(bytes)[0]
}

/// A few blocks of every record kind.
fn small_capture() -> (Vec<u8>, Vec<OwnedRecord>) {
    let ops = mixed_ops();
    let (bytes, want) = write_ops(&sample_header(), &ops, true);
    assert!(block_starts(&bytes).len() >= 4);
    (bytes, want)
}

#[test]
fn truncation_at_every_byte() {
    let (bytes, want) = small_capture();
    let hlen = header_len(&bytes);
    for len in 0..bytes.len() {
        let got = read_all(&bytes[..len]);
        let e = got.error.expect("a truncated capture must say so");
        assert!(want.starts_with(&got.records), "len {len}");
        assert!(got.skipped.is_empty(), "len {len}: {:?}", got.skipped);
        if len >= hlen {
            assert!(matches!(e, CaptureError::CutShort { .. }), "len {len}: {e}");
            assert!(got.records.len() < want.len());
        } else if len == 0 {
            assert!(matches!(e, CaptureError::NotACapture));
        } else {
            assert!(
                matches!(e, CaptureError::HeaderCutShort { .. }),
                "len {len}: {e}"
            );
        }
    }
    assert!(read_all(&bytes).error.is_none());
}

/// The block that holds byte `pos`.
fn block_of(starts: &[usize], pos: usize) -> usize {
    *starts.iter().rev().find(|&&s| s <= pos).unwrap()
}

/// The records of an intact capture, each with the offset of its block.
fn records_by_block(bytes: &[u8]) -> Vec<(usize, OwnedRecord)> {
    let (_, mut r) = CaptureReader::new(bytes).unwrap();
    let mut out = Vec::new();
    while let Some(rec) = r.next_owned() {
        out.push((r.block_offset() as usize, rec.unwrap()));
    }
    out
}

/// The records of `by_block` outside the blocks at `skipped`.
fn records_but(by_block: &[(usize, OwnedRecord)], skipped: &[usize]) -> Vec<OwnedRecord> {
    by_block
        .iter()
        .filter(|(b, _)| !skipped.contains(b))
        .map(|(_, r)| r.clone())
        .collect()
}

/// `bytes` is damaged at `pos` only: in the file header, which is fatal, or in one block,
/// whose records (only) are skipped, the place named, and reading goes on at the next block.
fn check_damaged(bytes: &[u8], by_block: &[(usize, OwnedRecord)], starts: &[usize], pos: usize) {
    let got = read_all(bytes);
    if pos < starts[0] {
        assert!(got.header.is_none(), "pos {pos}: damaged header accepted");
        return;
    }
    let block = block_of(starts, pos);
    let index = starts.iter().position(|&s| s == block).unwrap();
    assert_eq!(got.records, records_but(by_block, &[block]), "pos {pos}");
    let [region] = &got.skipped[..] else {
        panic!("pos {pos}: skipped {:?}", got.skipped);
    };
    assert_eq!(region.offset, block as u64, "pos {pos}: {region}");
    assert_eq!(region.block, index as u32, "pos {pos}: {region}");
    assert!(
        matches!(
            region.problem,
            Damage::BlockMagic { .. }
                | Damage::BlockHeaderChecksum { .. }
                | Damage::BlockChecksum { .. }
        ),
        "pos {pos}: {region}"
    );
    assert!(region
        .to_string()
        .starts_with(&format!("offset {block} (block {index}): ")));
    match starts.get(index + 1) {
        Some(&next) => {
            if matches!(region.problem, Damage::BlockChecksum { .. }) {
                // Its header held: it says how many records went.
                let n = by_block.iter().filter(|(b, _)| *b == block).count();
                assert_eq!(region.records_lost, Some(n as u64), "pos {pos}: {region}");
            }
            assert!(got.error.is_none(), "pos {pos}: {:?}", got.error);
            assert_eq!(region.resumed_at, Some(next as u64), "pos {pos}");
            assert_eq!(region.blocks_lost, Some(1), "pos {pos}");
            let short = got.damage.unwrap().shortfall.unwrap();
            assert_eq!(short.expected.blocks, short.read.blocks + 1, "pos {pos}");
        }
        None => {
            // The last block held the end record: the capture ends without one.
            assert!(
                matches!(got.error, Some(CaptureError::CutShort { .. })),
                "pos {pos}: {:?}",
                got.error
            );
            assert_eq!(region.resumed_at, None, "pos {pos}");
        }
    }
}

#[test]
fn flipped_byte_at_every_position() {
    let (bytes, _) = small_capture();
    let starts = block_starts(&bytes);
    let by_block = records_by_block(&bytes);
    for pos in 0..bytes.len() {
        let mut b = bytes.clone();
        b[pos] ^= 0xff;
        check_damaged(&b, &by_block, &starts, pos);
    }
}

#[test]
fn flipped_bit_at_every_position() {
    let (bytes, _) = small_capture();
    let starts = block_starts(&bytes);
    let by_block = records_by_block(&bytes);
    for pos in 0..bytes.len() {
        for bit in 0..8 {
            let mut b = bytes.clone();
            b[pos] ^= 1 << bit;
            check_damaged(&b, &by_block, &starts, pos);
        }
    }
}

/// A block with valid checksums around whatever payload: what a buggy or hostile writer makes.
fn craft_block(seq: u32, records: u32, raw_len: u32, compression: u8, stored: &[u8]) -> Vec<u8> {
    let h = BlockHeader {
        seq,
        records,
        raw_len,
        stored_len: stored.len() as u32,
        compression,
        payload_crc: crc32fast::hash(stored),
    };
    let mut b = h.encode().to_vec();
    b.extend_from_slice(stored);
    b
}

fn file_header() -> Vec<u8> {
    format::encode_file_header(&CaptureHeader::default()).unwrap()
}

/// A one-block capture of `records` (kind, body), then an end record holding `trailer`.
fn crafted_capture(records: &[(u8, &[u8])], trailer: Trailer) -> Vec<u8> {
    let mut end = Vec::new();
    format::encode_trailer(&trailer, &mut end);
    let mut payload = Vec::new();
    for &(kind, body) in records.iter().chain([(format::KIND_END, &end[..])].iter()) {
        payload.push(kind);
        format::put_varint(&mut payload, body.len() as u64);
        payload.extend_from_slice(body);
    }
    let n = records.len() as u32 + 1;
    let mut file = file_header();
    file.extend(craft_block(0, n, payload.len() as u32, 0, &payload));
    file
}

#[test]
fn unknown_kinds_are_skipped_critical_ones_refused() {
    let file = crafted_capture(
        &[
            (100u8, &b"from the future"[..]),
            (format::KIND_LOST, &[5, 6][..]),
            (0, &[][..]),
        ],
        Trailer {
            lost_records: 1,
            lost_events: 6,
            blocks: 1,
            ..Default::default()
        },
    );
    let (_, mut r) = CaptureReader::new(&file[..]).unwrap();
    assert_eq!(
        r.next_owned().unwrap().unwrap(),
        OwnedRecord::Lost { ts_ns: 5, count: 6 }
    );
    assert!(matches!(r.next_owned(), Some(Ok(OwnedRecord::End(_)))));
    assert_eq!(r.stats().unknown_records, 2);

    let payload = [0x90, 1, 0];
    let mut file = file_header();
    file.extend(craft_block(0, 1, 3, 0, &payload));
    let e = read_all(&file).error.unwrap();
    assert!(matches!(e, CaptureError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("upgrade xtlock"), "{e}");

    let mut file = file_header();
    file.extend(craft_block(0, 0, 0, 7, &[]));
    let e = read_all(&file).error.unwrap();
    assert!(e.to_string().contains("block compression 7"), "{e}");
}

#[test]
fn impossible_lengths_are_errors_not_allocations() {
    let mut file = file_header();
    let mut b = craft_block(0, 1, u32::MAX, 1, &[]);
    b[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    // Re-seal the header checksum so only the length is wrong.
    let crc = crc32fast::hash(&b[..28]);
    b[28..32].copy_from_slice(&crc.to_le_bytes());
    file.extend(b);
    let got = read_all(&file);
    assert!(
        matches!(
            got.skipped[..],
            [DamagedRegion {
                problem: Damage::BlockTooLarge { .. },
                resumed_at: None,
                ..
            }]
        ),
        "{:?}",
        got.skipped
    );
    assert!(got.error.unwrap().is_cut_short());

    let mut file = file_header();
    file[10..14].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = read_all(&file).error.unwrap();
    assert!(e.to_string().contains("header length"), "{e}");

    // A record length past the block.
    let mut file = file_header();
    let payload = [1u8, 0xff, 0xff, 0xff, 0xff, 0x0f, 0, 0];
    file.extend(craft_block(0, 1, payload.len() as u32, 0, &payload));
    let got = read_all(&file);
    let msg = got.skipped[0].to_string();
    assert!(msg.contains("runs past"), "{msg}");
    assert!(got.error.unwrap().is_cut_short());
}

#[test]
fn trailer_mismatch_and_record_count_are_damage() {
    let file = crafted_capture(
        &[],
        Trailer {
            kernel_events: 5,
            blocks: 1,
            ..Default::default()
        },
    );
    let e = read_all(&file).error.unwrap();
    assert!(e.to_string().contains("says kernel events 5"), "{e}");

    // Fewer records than the header says: the block's records are read, the count said.
    let mut file = file_header();
    file.extend(craft_block(0, 2, 4, 0, &[3, 2, 0, 0]));
    let got = read_all(&file);
    assert_eq!(got.records, [OwnedRecord::Lost { ts_ns: 0, count: 0 }]);
    let msg = got.skipped[0].to_string();
    assert!(msg.contains("its header says 2"), "{msg}");
    assert!(got.error.unwrap().is_cut_short());

    // A sequence gap between intact blocks: they are read, the gap said.
    let mut file = file_header();
    file.extend(craft_block(1, 1, 4, 0, &[3, 2, 7, 0]));
    let got = read_all(&file);
    assert_eq!(got.records, [OwnedRecord::Lost { ts_ns: 7, count: 0 }]);
    let hlen = file_header().len();
    assert_eq!(
        got.skipped[0].to_string(),
        format!(
            "offset {hlen} (block 0): block sequence number 1, expected 0; 1 block missing, \
             reading went on at offset {hlen}"
        )
    );
    assert!(got.error.unwrap().is_cut_short());
}

/// A Write that accepts `left` bytes, then fails.
struct FailAfter {
    left: usize,
}

impl Write for FailAfter {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Err(io::Error::other("disk full"));
        }
        let n = b.len().min(self.left);
        self.left -= n;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn writer_stops_after_a_failed_write() {
    let hlen = file_header().len();
    let mut w =
        CaptureWriter::new(FailAfter { left: hlen + 10 }, &CaptureHeader::default()).unwrap();
    w.write_kernel(&[1; 72]).unwrap();
    let e = w.flush_block().unwrap_err();
    assert!(
        matches!(e, CaptureError::Io { offset, .. } if offset == hlen as u64),
        "{e}"
    );
    assert!(matches!(
        w.write_kernel(&[1; 72]),
        Err(CaptureError::WriterFailed)
    ));
    assert!(matches!(w.finish(), Err(CaptureError::WriterFailed)));

    let mut w = CaptureWriter::new(Vec::new(), &CaptureHeader::default()).unwrap();
    let big = vec![0u8; format::MAX_RECORD_LEN + 1];
    assert!(matches!(
        w.write_kernel(&big),
        Err(CaptureError::RecordTooLarge { .. })
    ));
    // A refused record leaves the writer usable.
    w.write_kernel(&big[..10]).unwrap();
    assert_eq!(w.finish().unwrap().kernel_events, 1);
}

/// A realistic incident stream of lock events: short-lived iptables processes on one lock,
/// take / contend / release, timestamps rising by 10 µs .. 5 ms.
fn lock_stream(n: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(n);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = move |m: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    let mut ts = 3_600_000_000_000u64;
    let mut tgid = 412_000u32;
    while out.len() < n {
        tgid += 1 + rnd(7) as u32;
        let waiter = tgid + 1 + rnd(3) as u32;
        let step = |ts: &mut u64, r: u64| *ts += 10_000 + r;
        step(&mut ts, rnd(5_000_000));
        out.push(as_bytes(&lock_event(ts, tgid, common::F_WRLCK, 0)));
        if rnd(3) == 0 {
            step(&mut ts, rnd(1_000_000));
            out.push(as_bytes(&lock_event(
                ts,
                waiter,
                common::F_WRLCK,
                common::FILE_LOCK_DEFERRED,
            )));
        }
        step(&mut ts, rnd(5_000_000));
        out.push(as_bytes(&lock_event(ts, tgid, common::F_UNLCK, 0)));
    }
    out.truncate(n);
    out
}

fn bytes_per_event(events: &[Vec<u8>], flush_every: usize) -> f64 {
    let mut buf = Vec::new();
    let mut w = CaptureWriter::new(&mut buf, &sample_header()).unwrap();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.len(), 72);
        w.write_kernel(e).unwrap();
        if (i + 1) % flush_every == 0 {
            w.flush_block().unwrap();
        }
    }
    w.flush_block().unwrap();
    let per = w.stats().bytes_per_kernel_event().unwrap();
    w.finish().unwrap();
    per
}

#[test]
fn bytes_per_lock_event() {
    let events = lock_stream(50_000);
    let busy = bytes_per_event(&events, usize::MAX);
    let per_1000 = bytes_per_event(&events, 1000);
    let per_100 = bytes_per_event(&events, 100);
    let per_10 = bytes_per_event(&events[..5000], 10);
    eprintln!(
        "capture: bytes per 72-byte lock event on disk: {busy:.1} in full 64 KiB blocks, \
         {per_1000:.1} at 1000 events per flush, {per_100:.1} at 100, {per_10:.1} at 10"
    );
    assert!(busy < 48.0, "{busy}");
    assert!(per_100 < 48.0, "{per_100}");
}

/// Decoding speed of `events()`, for the record; run with
/// `cargo test --release -p xtlock --lib capture::tests::read_throughput -- --ignored --nocapture`.
#[test]
#[ignore]
fn read_throughput() {
    let events = lock_stream(200_000);
    let mut buf = Vec::new();
    let mut w = CaptureWriter::new(&mut buf, &CaptureHeader::default()).unwrap();
    let t = std::time::Instant::now();
    for _ in 0..10 {
        for e in &events {
            w.write_kernel(e).unwrap();
        }
    }
    w.finish().unwrap();
    let wrote = t.elapsed();
    let t = std::time::Instant::now();
    let (_, r) = CaptureReader::new(&buf[..]).unwrap();
    let mut n = 0u64;
    for e in r.events() {
        if let Event::Lock(l) = e.unwrap() {
            n += l.ts_ns & 1;
        }
    }
    let read = t.elapsed();
    let total = 10.0 * events.len() as f64;
    eprintln!(
        "capture: write {:.1} M events/s, read+decode {:.1} M events/s ({n})",
        total / wrote.as_secs_f64() / 1e6,
        total / read.as_secs_f64() / 1e6
    );
}

fn kernel_strategy() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        (
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<i32>(),
            any::<u32>(),
            0u8..3,
            any::<[u8; 16]>()
        )
            .prop_map(|(ts, tgid, tid, owner, ino, dev, ret, flags, ty, comm)| {
                let mut e = lock_event(ts, tgid, ty, ret);
                e.hdr.tid = tid;
                e.owner = owner;
                e.ino = ino;
                e.dev = dev;
                e.fl_flags = flags;
                e.comm = comm;
                as_bytes(&e)
            }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<i64>(),
            any::<u32>(),
            any::<u32>()
        )
            .prop_map(
                |(ts, enter, ret, cmd, tgid)| as_bytes(&common::FlockCallEvent {
                    hdr: hdr(common::EventKind::FlockCall, tgid, ts),
                    enter_ns: enter,
                    owner: ts ^ enter,
                    ino: 77,
                    ret,
                    cmd,
                    dev: 5,
                })
            ),
        (any::<u64>(), any::<u32>(), any::<[u8; 16]>()).prop_map(|(ts, child, comm)| {
            as_bytes(&common::ForkEvent {
                hdr: hdr(common::EventKind::Fork, 1, ts),
                child_tid: child,
                _pad: 0,
                comm,
            })
        }),
        (any::<u64>(), any::<i32>(), any::<u32>()).prop_map(|(ts, code, has)| {
            as_bytes(&common::ExitEvent {
                hdr: hdr(common::EventKind::Exit, 3, ts),
                exit_code: code,
                has_code: has,
                comm: [b'x'; 16],
            })
        }),
        // An exec event is integers and byte arrays: any bytes of its size are one.
        proptest::collection::vec(any::<u8>(), common::sizes::EXEC).prop_map(|mut b| {
            b[..4].copy_from_slice(&(common::EventKind::Exec as u32).to_le_bytes());
            b
        }),
        proptest::collection::vec(any::<u8>(), 0..300),
        // Mostly zeros: stored sparse.
        sparse_bytes().boxed(),
    ]
    .boxed()
}

fn proc_strategy() -> impl Strategy<Value = ProcInfo> {
    (
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<[u8; 16]>(),
        proptest::collection::vec(".{0,12}", 0..4),
        proptest::option::of(".{0,40}"),
    )
        .prop_map(|(ts_ns, pid, ppid, comm, argv, cgroup)| ProcInfo {
            ts_ns,
            pid,
            ppid,
            comm: Comm(comm),
            argv,
            cgroup,
            exe: None,
        })
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => kernel_strategy().prop_map(Op::Kernel),
        2 => proc_strategy().prop_map(Op::Proc),
        1 => (any::<u64>(), any::<u64>()).prop_map(|(t, c)| Op::Lost(t, c)),
        1 => Just(Op::Flush),
    ]
}

fn header_strategy() -> impl Strategy<Value = CaptureHeader> {
    (
        ".{0,20}",
        any::<i64>(),
        any::<u64>(),
        any::<u32>(),
        proptest::option::of(".{0,10}"),
    )
        .prop_map(|(hostname, off, started, dev, err)| CaptureHeader {
            hostname,
            boot_to_wall_offset_ns: off,
            started_wall_ns: started,
            locks: vec![CaptureLock {
                path: "/run/xtables.lock".into(),
                dev,
                ino: 9,
            }],
            probes: vec![CaptureProbe {
                program: "p".into(),
                attach: "a".into(),
                error: err,
            }],
            ..Default::default()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn prop_round_trip(h in header_strategy(), ops in proptest::collection::vec(op_strategy(), 0..150)) {
        let (bytes, want) = write_ops(&h, &ops, true);
        let got = read_all(&bytes);
        prop_assert!(got.error.is_none(), "{:?}", got.error);
        prop_assert_eq!(got.header, Some(h));
        prop_assert_eq!(got.records, want);
    }

    /// Whatever sits inside a block with good checksums, the reader does not panic and stops
    /// with an error or an end record.
    #[test]
    fn prop_crafted_blocks_never_panic(
        records in 0u32..10,
        compression in 0u8..3,
        raw_len in 0u32..5000,
        stored in proptest::collection::vec(any::<u8>(), 0..600),
        valid_prefix in any::<bool>(),
    ) {
        let mut file = file_header();
        if valid_prefix {
            let (b, _) = write_ops(&CaptureHeader::default(), &[Op::Lost(1, 1), Op::Flush], false);
            file = b;
        }
        let seq = u32::from(valid_prefix);
        let raw_len = if compression == 0 { stored.len() as u32 } else { raw_len };
        file.extend(craft_block(seq, records, raw_len, compression, &stored));
        let got = read_all(&file);
        let ended = got.error.is_some() || matches!(got.records.last(), Some(OwnedRecord::End(_)));
        prop_assert!(ended);
    }

    /// Random bytes after a valid file header.
    #[test]
    fn prop_garbage_never_panics(tail in proptest::collection::vec(any::<u8>(), 0..400)) {
        let mut file = file_header();
        file.extend_from_slice(b"XTLB");
        file.extend_from_slice(&tail);
        let _ = read_all(&file);
        let _ = read_all(&tail);
    }
}

/// Drops recorded live replay to the same facts: the drop sample as raw kernel bytes, the
/// reason names, symbols, counts and conntrack deltas as records of kinds 5..=8.
#[test]
fn drop_records_replay_to_the_same_facts() {
    use crate::analysis::{Analyzer, Output};
    use crate::decode::{ConntrackCounters, ConntrackStats, DropCount, DropCounts};
    const S: u64 = 1_000_000_000;
    let nf = 0xffff_ffff_81a0_007d;
    let mut sample = common::DropEvent {
        hdr: hdr(common::EventKind::Drop, 0, 2 * S - 5),
        location: nf,
        netns: 77,
        ifindex: 3,
        reason: 12,
        ethertype: 0x0800,
        l4proto: 17,
        family: common::DROP_FAMILY_INET,
        saddr: [0; 16],
        daddr: [0; 16],
        sport: 1234,
        dport: 7777,
        _pad: 0,
    };
    sample.saddr[..4].copy_from_slice(&[10, 202, 0, 1]);
    sample.daddr[..4].copy_from_slice(&[10, 202, 0, 2]);
    let raw = as_bytes(&sample);
    let synthetic = [
        Event::DropSetup {
            ts_ns: S,
            has_reason: true,
            host_netns: 1,
            names: vec![(12, "NETFILTER_DROP".into())],
        },
        Event::Conntrack(Box::new(ConntrackStats {
            ts_ns: 2 * S,
            interval_ns: S,
            netns: 77,
            deltas: ConntrackCounters {
                drop: 40,
                ..Default::default()
            },
            count: 64,
            max: 64,
        })),
        Event::KernelSymbol {
            ts_ns: 2 * S,
            addr: nf,
            name: "nf_hook_slow".into(),
            offset: 0x7d,
        },
        Event::DropCounts(DropCounts {
            ts_ns: 2 * S,
            interval_ns: S,
            counts: vec![DropCount {
                location: nf,
                reason: 12,
                netns: 77,
                count: 40,
            }],
            overflow: 0,
            holds: vec![],
        }),
    ];
    let mut live = Analyzer::new(vec![]);
    let mut want = Vec::new();
    let mut buf = Vec::new();
    let mut w = CaptureWriter::new(&mut buf, &CaptureHeader::default()).unwrap();
    let feed =
        |a: &mut Analyzer, ev: &Event, out: &mut Vec<Output>| a.process(ev, &mut |o| out.push(o));
    feed(&mut live, &synthetic[0], &mut want);
    assert!(w.write_synthetic(&synthetic[0]).unwrap());
    w.write_kernel(&raw).unwrap();
    feed(&mut live, &decode::decode(&raw).unwrap(), &mut want);
    for ev in &synthetic[1..] {
        assert!(w.write_synthetic(ev).unwrap());
        feed(&mut live, ev, &mut want);
    }
    assert!(!w.write_synthetic(&decode::decode(&raw).unwrap()).unwrap());
    w.finish().unwrap();
    let (_, r) = CaptureReader::new(&buf[..]).unwrap();
    let mut replay = Analyzer::new(vec![]);
    let mut got = Vec::new();
    for ev in r.events() {
        feed(&mut replay, &ev.unwrap(), &mut got);
    }
    assert_eq!(got, want);
    assert!(got.iter().any(|o| matches!(o, Output::DropCount(d)
        if d.count == 40 && d.class == crate::analysis::DropClass::ConntrackTableFull)));
    assert!(got.iter().any(|o| matches!(o, Output::Drop(d)
        if d.packet.as_ref().is_some_and(|p| p.dport == Some(7777)))));
    assert_eq!(replay.summary().drops, live.summary().drops);
}

/// A hold in place at the start (from /proc/locks) is recorded and replays to the same hold.
#[test]
fn lock_seed_round_trips() {
    use crate::analysis::{Analyzer, Output, WatchedLock};
    use crate::decode::LockSeed;
    let seed = Event::LockSeed(LockSeed {
        ts_ns: 1_000,
        pid: 4626,
        dev: 254 << 20,
        ino: 9_805_825,
        exclusive: true,
    });
    let mut buf = Vec::new();
    let mut w = CaptureWriter::new(&mut buf, &CaptureHeader::default()).unwrap();
    assert!(w.write_synthetic(&seed).unwrap());
    w.finish().unwrap();
    let (_, r) = CaptureReader::new(&buf[..]).unwrap();
    let events: Vec<Event> = r.events().map(|e| e.unwrap()).collect();
    assert_eq!(events, vec![seed]);
    let mut a = Analyzer::new(vec![WatchedLock::new(
        "/run/xtables.lock",
        254 << 20,
        9_805_825,
    )]);
    let mut out = Vec::new();
    a.process(&events[0], &mut |o| out.push(o));
    a.finish(5_000, &mut |o| out.push(o));
    assert!(
        out.iter().any(|o| matches!(o, Output::Hold(h)
            if h.before_start && h.pid == 4626 && h.open && h.hold_ns == 4_000)),
        "{out:?}"
    );
}

/// Record kinds of an undamaged capture, in order, the end record included.
fn record_kinds(bytes: &[u8]) -> Vec<u8> {
    let mut kinds = Vec::new();
    for at in block_starts(bytes) {
        let h = BlockHeader::decode(bytes[at..at + BLOCK_HEADER_LEN].try_into().unwrap());
        let stored = &bytes[at + BLOCK_HEADER_LEN..][..h.stored_len as usize];
        let raw = match h.compression {
            format::COMPRESSION_LZ4 => {
                lz4_flex::block::decompress(stored, h.raw_len as usize).unwrap()
            }
            _ => stored.to_vec(),
        };
        let mut pos = 0;
        while pos < raw.len() {
            kinds.push(raw[pos]);
            pos += 1;
            pos += format::get_varint(&raw, &mut pos).unwrap() as usize;
        }
    }
    kinds
}

/// One raw event of each kind, with the given fill for everything after the header.
fn every_kind(fill: u8) -> Vec<Vec<u8>> {
    use common::sizes;
    let sizes = [
        sizes::LOCK,
        sizes::FLOCK_CALL,
        sizes::EXEC,
        sizes::FORK,
        sizes::EXIT,
        sizes::TABLE_REPLACE,
        sizes::DROP,
        sizes::NFT_COMMIT,
        sizes::CONNTRACK_FAIL,
        sizes::XT_REPLACE,
        sizes::IPVS,
    ];
    (1u32..)
        .zip(sizes)
        .map(|(kind, size)| {
            let mut b = vec![fill; size];
            b[..4].copy_from_slice(&kind.to_le_bytes());
            b[4..8].copy_from_slice(&(1000 + kind).to_le_bytes());
            b[16..24].copy_from_slice(&(7_000_000 + u64::from(kind)).to_le_bytes());
            b
        })
        .collect()
}

/// Events with long zero runs are stored sparse, the others plain; both read back byte for
/// byte, decode the same, and count as kernel events in the stats and the end record.
#[test]
fn sparse_kernel_records_round_trip() {
    let exec = |filename: &[u8], fill: u8| {
        let mut e = common::ExecEvent {
            hdr: hdr(common::EventKind::Exec, 42, 9),
            filename: [fill; common::FILENAME_LEN],
            args: [[fill; common::ARG_LEN]; common::ARGV_SLOTS],
            argc: 1,
            args_truncated: 0,
            comm: Comm::new("iptables").0,
            netns: u32::from_ne_bytes([fill; 4]),
            _pad: u32::from_ne_bytes([fill; 4]),
        };
        e.filename[..filename.len()].copy_from_slice(filename);
        e.args[0][..8].copy_from_slice(b"iptables");
        as_bytes(&e)
    };
    // (event, stored sparse?)
    let mut cases: Vec<(Vec<u8>, bool)> = vec![
        (exec(b"/usr/sbin/iptables", 0), true),
        (exec(b"/usr/sbin/iptables", b'x'), false),
        (as_bytes(&lock_event(5, 7, common::F_WRLCK, 0)), false),
        (vec![0; 100], true),
        (vec![0; 16], true),
        (vec![0; 15], false),
        (Vec::new(), false),
        (vec![1; 300], false),
    ];
    // Zero runs at every alignment and odd lengths, at the start, middle and end.
    for shift in 0..9 {
        let mut b = vec![7u8; 61 + shift];
        b[shift..shift + 24].fill(0);
        b[40..].fill(0);
        cases.push((b, true));
        // Runs of 7 bytes never make a zero word: plain.
        let mut b = vec![7u8; 64 + shift];
        for run in b.chunks_mut(8) {
            run[1..].fill(0);
        }
        cases.push((b, false));
    }
    for e in every_kind(0) {
        cases.push((e, true));
    }
    for e in every_kind(0x5a) {
        cases.push((e, false));
    }
    let mut ops: Vec<Op> = cases.iter().map(|(b, _)| Op::Kernel(b.clone())).collect();
    ops.insert(3, Op::Proc(proc_info(7)));
    ops.insert(9, Op::Flush);
    let (bytes, want) = write_ops(&sample_header(), &ops, true);
    let got = read_all(&bytes);
    assert!(got.error.is_none(), "{:?}", got.error);
    assert_eq!(got.records, want);

    let kinds: Vec<u8> = record_kinds(&bytes)
        .into_iter()
        .filter(|&k| k == format::KIND_KERNEL || k == format::KIND_KERNEL_SPARSE)
        .collect();
    let expected: Vec<u8> = cases
        .iter()
        .map(|&(_, sparse)| match sparse {
            true => format::KIND_KERNEL_SPARSE,
            false => format::KIND_KERNEL,
        })
        .collect();
    assert_eq!(kinds, expected);

    let (_, r) = CaptureReader::new(&bytes[..]).unwrap();
    let mut events = r.events();
    for (raw, _) in &cases {
        let got = events.next().unwrap();
        match decode::decode(raw) {
            Ok(ev) => assert_eq!(got.unwrap(), ev),
            Err(_) => assert!(matches!(got, Err(CaptureError::Decode { .. }))),
        }
        if raw == &cases[2].0 {
            assert!(matches!(events.next(), Some(Ok(Event::Proc(_)))));
        }
    }
    assert!(events.next().is_none());
    let stats = events.reader().stats();
    assert_eq!(stats.kernel_events, cases.len() as u64);
    assert_eq!(stats.proc_records, 1);
    assert_eq!(
        events.reader().trailer().unwrap().kernel_events,
        cases.len() as u64
    );
}

/// The sparse record kind must be one old readers refuse, not one they skip.
#[test]
fn sparse_kind_is_critical() {
    const { assert!(format::KIND_KERNEL_SPARSE >= format::KIND_CRITICAL_MIN) };
}

/// A capture of one record of `kind` with `body`, then the end record (one kernel event).
fn one_record_capture(kind: u8, body: &[u8]) -> Vec<u8> {
    let trailer = Trailer {
        kernel_events: 1,
        blocks: 1,
        ..Default::default()
    };
    crafted_capture(&[(kind, body)], trailer)
}

fn varints(vs: &[u64]) -> Vec<u8> {
    let mut b = Vec::new();
    for &v in vs {
        format::put_varint(&mut b, v);
    }
    b
}

#[test]
fn corrupt_sparse_bodies_are_damage() {
    // A good one first: 3 literal bytes, 20 zeros, 1 literal byte.
    let mut good = varints(&[24, 3]);
    good.extend_from_slice(b"abc");
    good.extend(varints(&[20, 1]));
    good.push(b'z');
    let got = read_all(&one_record_capture(format::KIND_KERNEL_SPARSE, &good));
    assert!(got.error.is_none(), "{:?}", got.error);
    let mut want = b"abc".to_vec();
    want.extend_from_slice(&[0; 20]);
    want.push(b'z');
    assert_eq!(got.records[0], OwnedRecord::Kernel(want));

    let with_literal = |vs: &[u64], lit: &[u8], rest: &[u64]| {
        let mut b = varints(vs);
        b.extend_from_slice(lit);
        b.extend(varints(rest));
        b
    };
    let max = format::MAX_SPARSE_KERNEL_LEN as u64;
    for (body, why) in [
        (Vec::new(), "total length"),
        (vec![0x80], "total length"),
        (varints(&[max + 1, 0, max + 1]), "at most"),
        (varints(&[u64::MAX]), "at most"),
        (varints(&[10, 11]), "runs past the total"),
        (with_literal(&[10, 2], b"ab", &[9]), "runs past the total"),
        (
            with_literal(&[10, 2], b"ab", &[u64::MAX]),
            "runs past the total",
        ),
        (varints(&[10, 5]), "runs past the record"),
        (with_literal(&[10, 5], b"abc", &[]), "runs past the record"),
        (with_literal(&[10, 2], b"ab", &[]), "zero run length"),
        (with_literal(&[10, 2], b"ab", &[3]), "literal length"),
        (
            with_literal(&[10, 2], b"ab", &[3, 128])[..6].to_vec(),
            "literal length",
        ),
        (with_literal(&[2, 2], b"ab", &[0]), "after the last segment"),
        (varints(&[0, 0]), "after the last segment"),
        (varints(&[8, 0, 8, 0]), "after the last segment"),
    ] {
        let file = one_record_capture(format::KIND_KERNEL_SPARSE, &body);
        let got = read_all(&file);
        let [region] = &got.skipped[..] else {
            panic!("{body:?}: a bad sparse body is damage: {:?}", got.skipped);
        };
        assert!(
            matches!(
                region,
                DamagedRegion {
                    problem: Damage::Record { record: 0, .. },
                    partial: true,
                    ..
                }
            ),
            "{body:?}: {region}"
        );
        assert!(region.to_string().contains(why), "{body:?}: {region}");
        // The end record went with the rest of the block.
        assert!(got.records.is_empty());
        assert!(got.error.unwrap().is_cut_short());
    }
    // An empty event is well formed (and decodes as too short, like a plain one).
    let got = read_all(&one_record_capture(format::KIND_KERNEL_SPARSE, &[0]));
    assert!(got.error.is_none(), "{:?}", got.error);
    assert_eq!(got.records[0], OwnedRecord::Kernel(Vec::new()));
}

/// Sparse bodies of a long event then a short one: the short one is not padded or mixed with
/// what the long one left in the reader's buffer.
#[test]
fn sparse_buffer_reuse() {
    let long: Vec<u8> = (0..600).map(|i| if i % 100 < 50 { 0 } else { 9 }).collect();
    let mut short = vec![3u8; 40];
    short[8..32].fill(0);
    let ops = [long.clone(), short.clone(), long]
        .into_iter()
        .map(Op::Kernel)
        .collect::<Vec<_>>();
    let (bytes, want) = write_ops(&CaptureHeader::default(), &ops, true);
    assert_eq!(read_all(&bytes).records, want);
    assert_eq!(record_kinds(&bytes), [128, 128, 128, format::KIND_END]);
}

fn sparse_bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(prop_oneof![3 => Just(0u8), 1 => any::<u8>()], 0..800)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// Whatever the bytes, the sparse body (when the writer picks it) expands back to them
    /// and is shorter; when it does not, the output buffer is untouched.
    #[test]
    fn prop_sparse_encoding(raw in sparse_bytes(), prefix in proptest::collection::vec(any::<u8>(), 0..4)) {
        let mut out = prefix.clone();
        if format::encode_sparse_kernel(&raw, &mut out) {
            prop_assert!(out.len() - prefix.len() < raw.len());
            let mut buf = vec![0xee; 5];
            let n = format::expand_sparse_kernel(&out[prefix.len()..], &mut buf).unwrap();
            prop_assert_eq!(&buf[..n], &raw[..]);
        } else {
            prop_assert_eq!(out, prefix);
        }
    }

    /// Random sparse bodies never panic: an event or a record error.
    #[test]
    fn prop_sparse_garbage(body in proptest::collection::vec(any::<u8>(), 0..64)) {
        let mut buf = Vec::new();
        if let Ok(n) = format::expand_sparse_kernel(&body, &mut buf) {
            prop_assert!(n <= buf.len() && n <= format::MAX_SPARSE_KERNEL_LEN);
        }
        let got = read_all(&one_record_capture(format::KIND_KERNEL_SPARSE, &body));
        for region in &got.skipped {
            let is_record_damage = matches!(region.problem, Damage::Record { .. });
            prop_assert!(is_record_damage, "{}", region);
        }
        if let Some(e) = got.error {
            prop_assert!(e.is_cut_short(), "{}", e);
        }
    }
}

// Damage is skipped: the reader reads on from the next intact block and says what it lost.

/// 300 lock events and a process record in 9 blocks of the real writer (the end record in the
/// last); the blocks' offsets, and each record with its block's offset.
fn nine_blocks() -> (Vec<u8>, Vec<usize>, Vec<(usize, OwnedRecord)>) {
    let mut ops = vec![Op::Proc(proc_info(412_000))];
    for (i, ev) in lock_stream(300).into_iter().enumerate() {
        ops.push(Op::Kernel(ev));
        if i % 34 == 33 {
            ops.push(Op::Flush);
        }
    }
    let (bytes, want) = write_ops(&sample_header(), &ops, true);
    let starts = block_starts(&bytes);
    assert_eq!(starts.len(), 9);
    let by_block = records_by_block(&bytes);
    let records: Vec<_> = by_block.iter().map(|(_, r)| r.clone()).collect();
    assert_eq!(records, want);
    (bytes, starts, by_block)
}

fn records_in(by_block: &[(usize, OwnedRecord)], block: usize) -> u64 {
    by_block.iter().filter(|(b, _)| *b == block).count() as u64
}

#[test]
fn flipped_payload_byte_skips_exactly_that_block() {
    let (mut bytes, starts, by_block) = nine_blocks();
    let (b3, b4) = (starts[3], starts[4]);
    let payload = b3 + BLOCK_HEADER_LEN;
    bytes[payload + 17] ^= 0x01;
    let got = read_all(&bytes);
    assert!(got.error.is_none(), "{:?}", got.error);
    // Every record of the 8 other blocks, the end record included; none of block 3's.
    assert_eq!(got.records, records_but(&by_block, &[b3]));
    let n3 = records_in(&by_block, b3);
    assert_eq!(n3, 34);
    let region = &got.skipped[0];
    assert_eq!(
        *region,
        DamagedRegion {
            offset: b3 as u64,
            block: 3,
            problem: region.problem.clone(),
            partial: false,
            blocks_lost: Some(1),
            records_lost: Some(n3),
            bytes: (b4 - b3) as u64,
            resumed_at: Some(b4 as u64),
        }
    );
    let expected = u32::from_le_bytes(bytes[b3 + 24..b3 + 28].try_into().unwrap());
    let found = crc32fast::hash(&bytes[payload..b4]);
    // What `report` says, word for word.
    assert_eq!(
        got.damage.unwrap().lines(),
        [
            format!(
                "capture damaged in 1 place: offset {b3} (block 3): payload checksum mismatch \
                 (expected {expected:#010x}, found {found:#010x}); 1 block (34 records) \
                 skipped, reading went on at offset {b4}"
            ),
            "the end-of-capture record's totals are short by what the damage took: 1 block, \
             34 kernel events not read"
                .to_string(),
        ]
    );
}

#[test]
fn flipped_header_byte_skips_exactly_that_block() {
    let (bytes, starts, by_block) = nine_blocks();
    let (b3, b4) = (starts[3], starts[4]);
    // Magic, sequence number, records, lengths, compression, both checksums.
    for at in [0, 2, 5, 9, 13, 17, 20, 25, 30] {
        let mut b = bytes.clone();
        b[b3 + at] ^= 0x40;
        let got = read_all(&b);
        assert!(got.error.is_none(), "{at}: {:?}", got.error);
        assert_eq!(got.records, records_but(&by_block, &[b3]), "{at}");
        let [region] = &got.skipped[..] else {
            panic!("{at}: {:?}", got.skipped);
        };
        assert_eq!(region.offset, b3 as u64, "{at}");
        assert_eq!(region.block, 3, "{at}");
        assert_eq!(region.blocks_lost, Some(1), "{at}");
        assert_eq!(region.resumed_at, Some(b4 as u64), "{at}");
        if at < 4 {
            assert!(
                matches!(region.problem, Damage::BlockMagic { .. }),
                "{region}"
            );
        } else {
            assert!(
                matches!(region.problem, Damage::BlockHeaderChecksum { .. }),
                "{region}"
            );
        }
        // The header that would say how many records is the damaged one.
        assert_eq!(region.records_lost, None, "{at}");
        assert!(
            region.to_string().ends_with(&format!(
                "; 1 block skipped, reading went on at offset {b4}"
            )),
            "{region}"
        );
        // The end record knows: 34 events.
        let short = got.damage.unwrap().shortfall.unwrap();
        assert_eq!(short.expected.kernel_events - short.read.kernel_events, 34);
    }
}

/// `bytes` with block `index` rebuilt, uncompressed, after `edit` changed its records.
fn rebuild_block(bytes: &[u8], index: usize, edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let starts = block_starts(bytes);
    let at = starts[index];
    let hb: [u8; BLOCK_HEADER_LEN] = bytes[at..at + BLOCK_HEADER_LEN].try_into().unwrap();
    let h = BlockHeader::decode(&hb);
    let stored = &bytes[at + BLOCK_HEADER_LEN..at + BLOCK_HEADER_LEN + h.stored_len as usize];
    let mut raw = if h.compression == format::COMPRESSION_LZ4 {
        lz4_flex::block::decompress(stored, h.raw_len as usize).unwrap()
    } else {
        stored.to_vec()
    };
    edit(&mut raw);
    let mut out = bytes[..at].to_vec();
    out.extend(craft_block(h.seq, h.records, raw.len() as u32, 0, &raw));
    out.extend_from_slice(&bytes[at + BLOCK_HEADER_LEN + stored.len()..]);
    out
}

/// Start of record `n` in a block's records, and of its length varint.
fn record_at(raw: &[u8], n: usize) -> (usize, usize) {
    let mut pos = 0;
    for _ in 0..n {
        let mut p = pos + 1;
        let len = format::get_varint(raw, &mut p).unwrap();
        pos = p + len as usize;
    }
    (pos, pos + 1)
}

#[test]
fn malformed_record_drops_the_rest_of_its_block() {
    let (bytes, _, by_block) = nine_blocks();
    let b3 = block_starts(&bytes)[3];
    // Record 5's length runs past the block; the block's checksums are made to hold.
    let bad = rebuild_block(&bytes, 3, |raw| {
        let (start, len_at) = record_at(raw, 5);
        assert_eq!(raw[start], format::KIND_KERNEL);
        let mut p = len_at;
        format::get_varint(raw, &mut p).unwrap();
        raw.splice(len_at..p, varints(&[0x0fff_ffff]));
    });
    let starts = block_starts(&bad);
    let got = read_all(&bad);
    assert!(got.error.is_none(), "{:?}", got.error);
    // Block 3's first 5 records are read, its other 29 dropped, the later blocks read.
    let mut want = Vec::new();
    let mut in_3 = 0;
    for (b, r) in &by_block {
        if *b == b3 {
            in_3 += 1;
            if in_3 > 5 {
                continue;
            }
        }
        want.push(r.clone());
    }
    assert_eq!(got.records, want);
    let [region] = &got.skipped[..] else {
        panic!("{:?}", got.skipped);
    };
    assert!(
        matches!(&region.problem, Damage::Record { record: 5, reason } if reason.contains("runs past")),
        "{region}"
    );
    assert!(region.partial);
    assert_eq!(region.offset, b3 as u64);
    assert_eq!(region.blocks_lost, Some(0));
    assert_eq!(region.records_lost, Some(29));
    assert_eq!(region.resumed_at, Some(starts[4] as u64));
    assert!(
        region.to_string().ends_with(&format!(
            "; the rest of the block (29 records) skipped, reading went on at offset {}",
            starts[4]
        )),
        "{region}"
    );
    let short = got.damage.unwrap().shortfall.unwrap();
    assert_eq!(short.expected.blocks, short.read.blocks);
    assert_eq!(short.expected.kernel_events - short.read.kernel_events, 29);

    // A body that does not decode (a process record cut in two) does the same.
    let bad = rebuild_block(&bytes, 0, |raw| {
        assert_eq!(raw[0], format::KIND_PROC);
        let mut p = 1;
        let len = format::get_varint(raw, &mut p).unwrap() as usize;
        let half = len / 2;
        raw.drain(p + half..p + len);
        raw.splice(1..p, varints(&[half as u64]));
    });
    let got = read_all(&bad);
    let b0 = block_starts(&bytes)[0];
    assert_eq!(
        got.records,
        records_but(&by_block, &[b0]),
        "{:?}",
        got.skipped
    );
    assert!(
        matches!(got.skipped[0].problem, Damage::Record { record: 0, .. }),
        "{}",
        got.skipped[0]
    );
    assert_eq!(got.skipped[0].records_lost, Some(35));
}

#[test]
fn damage_in_two_places() {
    let (mut bytes, starts, by_block) = nine_blocks();
    bytes[starts[2] + BLOCK_HEADER_LEN + 3] ^= 0x80;
    bytes[starts[6] + 12] ^= 0x01;
    let got = read_all(&bytes);
    assert!(got.error.is_none(), "{:?}", got.error);
    assert_eq!(got.records, records_but(&by_block, &[starts[2], starts[6]]));
    let offsets: Vec<_> = got
        .skipped
        .iter()
        .map(|r| (r.offset, r.resumed_at))
        .collect();
    assert_eq!(
        offsets,
        [
            (starts[2] as u64, Some(starts[3] as u64)),
            (starts[6] as u64, Some(starts[7] as u64)),
        ]
    );
    let lines = got.damage.unwrap().lines();
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[0], "capture damaged in 2 places:");
    assert!(
        lines[1].starts_with(&format!(
            "damage 1 of 2: offset {} (block 2): payload checksum mismatch",
            starts[2]
        )),
        "{lines:?}"
    );
    assert!(
        lines[2].starts_with(&format!(
            "damage 2 of 2: offset {} (block 6): block header checksum mismatch",
            starts[6]
        )),
        "{lines:?}"
    );
    assert_eq!(
        lines[3],
        "the end-of-capture record's totals are short by what the damage took: 2 blocks, \
         68 kernel events not read"
    );

    // Two damaged blocks in a row are one place, two blocks long.
    let (mut bytes, starts, by_block) = nine_blocks();
    bytes[starts[3] + BLOCK_HEADER_LEN + 3] ^= 0x80;
    bytes[starts[4] + BLOCK_HEADER_LEN + 3] ^= 0x80;
    let got = read_all(&bytes);
    assert_eq!(got.records, records_but(&by_block, &[starts[3], starts[4]]));
    let [region] = &got.skipped[..] else {
        panic!("{:?}", got.skipped);
    };
    assert_eq!(region.resumed_at, Some(starts[5] as u64));
    assert_eq!(region.blocks_lost, Some(2));
    assert_eq!(region.records_lost, Some(68));
    assert!(
        region
            .to_string()
            .contains("; 2 blocks (68 records) skipped"),
        "{region}"
    );
}

#[test]
fn garbage_between_blocks_is_skipped() {
    let (bytes, starts, by_block) = nine_blocks();
    let b5 = starts[5];
    // Garbage with false starts: the magic, and the magic with a header that does not hold.
    let mut junk = b"XTLBXTL garbage X".to_vec();
    junk.extend_from_slice(&bytes[starts[2]..starts[2] + 27]);
    junk.extend_from_slice(&[0xaa; 40]);
    let mut bad = bytes[..b5].to_vec();
    bad.extend_from_slice(&junk);
    bad.extend_from_slice(&bytes[b5..]);
    let got = read_all(&bad);
    assert!(got.error.is_none(), "{:?}", got.error);
    let all: Vec<_> = by_block.iter().map(|(_, r)| r.clone()).collect();
    assert_eq!(got.records, all);
    let [region] = &got.skipped[..] else {
        panic!("{:?}", got.skipped);
    };
    assert_eq!(region.offset, b5 as u64);
    assert_eq!(region.blocks_lost, Some(0));
    assert_eq!(region.records_lost, Some(0));
    let resumed = b5 + junk.len();
    assert_eq!(region.resumed_at, Some(resumed as u64));
    // The magic is there, the header after it does not hold.
    assert!(
        matches!(region.problem, Damage::BlockHeaderChecksum { .. }),
        "{region}"
    );
    assert!(
        region.to_string().ends_with(&format!(
            "; {} bytes holding no block skipped, reading went on at offset {resumed}",
            junk.len()
        )),
        "{region}"
    );
    assert_eq!(
        got.damage.unwrap().lines()[1],
        "the end-of-capture record's totals match what was read: nothing was lost"
    );
}

#[test]
fn a_missing_block_is_counted_by_sequence_numbers() {
    let (bytes, starts, by_block) = nine_blocks();
    let mut bad = bytes[..starts[4]].to_vec();
    bad.extend_from_slice(&bytes[starts[5]..]);
    let got = read_all(&bad);
    assert!(got.error.is_none(), "{:?}", got.error);
    assert_eq!(got.records, records_but(&by_block, &[starts[4]]));
    let [region] = &got.skipped[..] else {
        panic!("{:?}", got.skipped);
    };
    assert_eq!(
        region.to_string(),
        format!(
            "offset {0} (block 4): block sequence number 5, expected 4; 1 block missing, \
             reading went on at offset {0}",
            starts[4]
        )
    );
    // Numbers going backwards tell nothing.
    assert_eq!(super::reader::gap(4, 5), Some(1));
    assert_eq!(super::reader::gap(u32::MAX, 1), Some(2));
    assert_eq!(super::reader::gap(5, 4), None);
}

#[test]
fn damage_at_the_end_reads_as_cut_short_after_it() {
    let (mut bytes, starts, by_block) = nine_blocks();
    bytes[starts[8] + BLOCK_HEADER_LEN + 3] ^= 0x80;
    let got = read_all(&bytes);
    assert_eq!(got.records, records_but(&by_block, &[starts[8]]));
    let [region] = &got.skipped[..] else {
        panic!("{:?}", got.skipped);
    };
    assert_eq!(region.resumed_at, None);
    assert_eq!(region.blocks_lost, None);
    assert!(
        region.to_string().ends_with(&format!(
            "; everything from there ({} bytes) skipped: no intact block follows before the \
             end of the file",
            super::thousands((bytes.len() - starts[8]) as u64)
        )),
        "{region}"
    );
    let e = got.error.unwrap();
    assert!(
        matches!(e, CaptureError::CutShort { offset, partial: None, .. } if offset == bytes.len() as u64),
        "{e}"
    );
}

/// `report` and `export` read through the file source: damage is skipped and summed up, not
/// an error that ends the report.
#[test]
fn file_source_reads_past_damage() {
    let (mut bytes, starts, _) = nine_blocks();
    let dir = std::env::temp_dir().join(format!("xtlock-capture-damage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("damaged.xtcap");
    let count = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        let mut src = crate::source::file::FileSource::open(&path).unwrap();
        let mut n = 0u64;
        let end = src
            .for_each(|_| {
                n += 1;
                Ok(())
            })
            .unwrap();
        (n, end)
    };
    let (all, end) = count(&bytes);
    assert!(end.damage.is_none() && end.damaged.is_none() && end.cut_short.is_none());
    bytes[starts[3] + BLOCK_HEADER_LEN + 9] ^= 0x04;
    let (n, end) = count(&bytes);
    assert!(end.damaged.is_none(), "{:?}", end.damaged);
    assert!(end.cut_short.is_none(), "{:?}", end.cut_short);
    assert!(n < all && n >= all - 34, "{n} of {all}");
    let d = end.damage.unwrap();
    assert!(
        d.lines()[0].starts_with(&format!(
            "capture damaged in 1 place: offset {} (block 3): payload checksum mismatch",
            starts[3]
        )),
        "{d}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Records read back are ones written, in order: `got` is a subsequence of `want`.
fn is_subsequence(got: &[OwnedRecord], want: &[OwnedRecord]) -> bool {
    let mut want = want.iter();
    got.iter().all(|g| want.any(|w| w == g))
}

#[test]
fn flipped_byte_anywhere_never_invents_records() {
    let mut ops = Vec::new();
    for (i, ev) in lock_stream(40).into_iter().enumerate() {
        ops.push(Op::Kernel(ev));
        if i % 5 == 4 {
            ops.push(Op::Flush);
        }
    }
    let (bytes, want) = write_ops(&CaptureHeader::default(), &ops, true);
    assert!(block_starts(&bytes).len() >= 8);
    let hlen = header_len(&bytes);
    for pos in hlen..bytes.len() {
        for flip in [0x01, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[pos] ^= flip;
            let got = read_all(&b);
            assert!(is_subsequence(&got.records, &want), "pos {pos}");
            assert_eq!(got.skipped.len(), 1, "pos {pos}");
            // At most one block (the damaged one) is lost.
            assert!(got.records.len() + 6 >= want.len(), "pos {pos}");
        }
    }
}

#[derive(Clone, Debug)]
enum Harm {
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
}

fn harm_strategy() -> impl Strategy<Value = Harm> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, x)| Harm::Flip(at, x)),
        (
            any::<usize>(),
            proptest::collection::vec(
                prop_oneof![Just(b'X'), Just(b'T'), Just(b'L'), Just(b'B'), any::<u8>()],
                1..80
            )
        )
            .prop_map(|(at, b)| Harm::Insert(at, b)),
        (any::<usize>(), 1usize..200).prop_map(|(at, n)| Harm::Delete(at, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Whatever is flipped, inserted or cut out after the file header, the reader does not
    /// panic, returns only records that were written, in order, and ends with an end record
    /// or an error.
    #[test]
    fn prop_damage_never_invents_records(harms in proptest::collection::vec(harm_strategy(), 1..5)) {
        let mut ops = Vec::new();
        for (i, ev) in lock_stream(60).into_iter().enumerate() {
            ops.push(Op::Kernel(ev));
            if i % 7 == 6 {
                ops.push(Op::Flush);
            }
        }
        let (mut bytes, want) = write_ops(&CaptureHeader::default(), &ops, true);
        let hlen = header_len(&bytes);
        for harm in harms {
            let span = bytes.len() - hlen;
            match harm {
                Harm::Flip(at, x) => bytes[hlen + at % span] ^= x,
                Harm::Insert(at, b) => {
                    let at = hlen + at % (span + 1);
                    bytes.splice(at..at, b);
                }
                Harm::Delete(at, n) => {
                    let at = hlen + at % span;
                    let end = (at + n).min(bytes.len());
                    bytes.drain(at..end);
                }
            }
            if bytes.len() == hlen {
                break;
            }
        }
        let got = read_all(&bytes);
        prop_assert!(got.header.is_some());
        prop_assert!(is_subsequence(&got.records, &want));
        let ended = got.error.is_some() || matches!(got.records.last(), Some(OwnedRecord::End(_)));
        prop_assert!(ended);
    }
}
