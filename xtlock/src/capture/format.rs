//! Byte layout of a capture file: constants, the file header, block headers and record
//! encodings. `docs/capture-format.md` is the specification; this file must agree with it.
//!
//! Everything here is pure (bytes in, values out) so the writer and the reader share one
//! definition of each layout, and nothing here panics on any input.

use serde::{Deserialize, Serialize};

use crate::event::AddrWhy;

use crate::decode::{
    Comm, ConntrackCounters, ConntrackStats, DropCount, DropCounts, Event, HoldDropCount,
    IpvsCounts, LockSeed, ProcInfo, RefusalCount, RefusalCounts,
};

/// First 8 bytes of every capture.
pub const MAGIC: [u8; 8] = *b"XTLKCAP\0";
/// The format version this build writes, and the newest it reads.
pub const FORMAT_VERSION: u16 = 1;
/// Magic + version + header length: the fixed part before the header JSON.
pub const FILE_PREFIX_LEN: usize = 14;
/// A header JSON longer than this is damage, not a header.
pub const MAX_HEADER_JSON: usize = 1 << 20;

/// First 4 bytes of every block.
pub const BLOCK_MAGIC: [u8; 4] = *b"XTLB";
/// Fixed size of a block header.
pub const BLOCK_HEADER_LEN: usize = 32;
/// The writer seals a block once its records reach this many (uncompressed) bytes.
pub const BLOCK_TARGET: usize = 64 << 10;
/// Readers refuse blocks (stored or uncompressed) larger than this: a length past it is damage,
/// and it bounds what a reader allocates.
pub const MAX_BLOCK_LEN: usize = 16 << 20;
/// Largest record body the writer accepts (a block then stays far below `MAX_BLOCK_LEN`).
pub const MAX_RECORD_LEN: usize = 1 << 20;

/// Block payload stored as is.
pub const COMPRESSION_NONE: u8 = 0;
/// Block payload compressed as one LZ4 block (no frame, no size prefix).
pub const COMPRESSION_LZ4: u8 = 1;

/// Record kinds.
pub const KIND_KERNEL: u8 = 1;
pub const KIND_PROC: u8 = 2;
pub const KIND_LOST: u8 = 3;
pub const KIND_END: u8 = 4;
/// Synthetic drop records (skippable: a reader that does not know them loses only drops).
pub const KIND_DROP_SETUP: u8 = 5;
pub const KIND_KERNEL_SYMBOL: u8 = 6;
pub const KIND_DROP_COUNTS: u8 = 7;
pub const KIND_CONNTRACK: u8 = 8;
/// A flock held on a watched lock when recording began (from `/proc/locks`).
pub const KIND_LOCK_SEED: u8 = 9;
/// Synthetic IPVS packet counts (skippable like the drop records).
pub const KIND_IPVS_COUNTS: u8 = 10;
/// Synthetic: the kubelet's names of a container or pod (skippable: a reader that does not
/// know it loses only pod names).
pub const KIND_POD: u8 = 11;
/// Synthetic refusal counts (skippable: a reader that does not know it loses only refusals).
pub const KIND_REFUSAL_COUNTS: u8 = 12;
/// Synthetic: a legacy table read after a write (skippable: a reader that does not know it
/// loses only the rule diffs).
pub const KIND_RULE_TABLE: u8 = 13;
/// Synthetic: an address appeared on or vanished from this node (skippable: a reader that does
/// not know it loses only the dead-endpoint times).
pub const KIND_ADDR: u8 = 14;
/// Synthetic: conntrack entries DNATed to an address gone from this node (skippable: a reader
/// that does not know it loses only the unanswered connections and stale entries).
pub const KIND_CT_ENTRIES: u8 = 15;
/// Synthetic: an endpoint anywhere whose DNATed connections went unanswered, or that answers
/// again (skippable: a reader that does not know it loses only those windows). Its own kind:
/// kind 14's readers take an unknown reason for damage.
pub const KIND_ENDPOINT_ANSWERS: u8 = 16;
/// Synthetic: the IPVS virtual and real servers of a namespace, read over netlink when they
/// changed (skippable: a reader that does not know it loses only IPVS's dead endpoints).
pub const KIND_IPVS_TABLE: u8 = 17;
/// Synthetic: what each dropping rule of a table counted since the previous read of its
/// counters (skippable: a reader that does not know it loses only the rules behind drops).
pub const KIND_RULE_COUNTERS: u8 = 18;
/// Virtual servers, and real servers in all, one `ipvs_table` record holds at most.
pub const MAX_IPVS_SERVICES: u64 = 65_536;
pub const MAX_IPVS_DESTS: u64 = 1 << 20;
/// Entries one `ct_entries` record holds at most (the source lists fewer).
pub const MAX_CT_ENTRIES: u64 = 4096;
/// Kinds from here up must be understood: a reader that does not know one stops with an
/// error instead of skipping it. Kinds below it that a reader does not know are skipped.
pub const KIND_CRITICAL_MIN: u8 = 0x80;
/// A kernel event with its zero runs elided (see [`encode_sparse_kernel`]). Critical: a reader
/// that skipped it would lose events without a word.
pub const KIND_KERNEL_SPARSE: u8 = 0x80;

/// Largest kernel event a sparse record may expand to (the largest `xtlock-common` struct is
/// under 1 KiB); bounds what a reader allocates for one.
pub const MAX_SPARSE_KERNEL_LEN: usize = 64 << 10;
/// The writer elides zero runs only when they add up to at least this many bytes.
pub const SPARSE_MIN_ELIDED: usize = 16;

/// What the recorder knew when it started. JSON in the file, so fields can be added without a
/// format version change: readers ignore fields they do not know and default missing ones.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CaptureHeader {
    /// Version of the xtlock that wrote the capture.
    pub xtlock_version: String,
    pub hostname: String,
    /// `uname -r` of the traced kernel.
    pub kernel_release: String,
    /// Wall-clock ns minus `CLOCK_MONOTONIC` ns when recording started: add it to an event's
    /// `ts_ns` to get Unix-epoch nanoseconds.
    pub boot_to_wall_offset_ns: i64,
    /// Unix-epoch nanoseconds when recording started.
    pub started_wall_ns: u64,
    /// The lock files watched.
    pub locks: Vec<CaptureLock>,
    /// Every probe the recorder tried to attach, and how it went.
    pub probes: Vec<CaptureProbe>,
    /// Anything else; for additions that do not deserve a field yet.
    pub extra: serde_json::Value,
}

impl CaptureHeader {
    /// Unix-epoch nanoseconds of a kernel (`CLOCK_MONOTONIC`) timestamp of this capture.
    pub fn wall_ns(&self, ts_ns: u64) -> i128 {
        i128::from(ts_ns) + i128::from(self.boot_to_wall_offset_ns)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CaptureLock {
    pub path: String,
    /// Kernel encoding (`major << 20 | minor`), as lock events carry it.
    pub dev: u32,
    pub ino: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CaptureProbe {
    /// BPF program name.
    pub program: String,
    /// Where it was attached (e.g. `filelock/flock_lock_inode`).
    pub attach: String,
    /// Why it did not attach; `None` when it did.
    pub error: Option<String>,
}

/// The end-of-capture record: counts of everything written before it. Its presence means the
/// recorder finished cleanly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Trailer {
    pub kernel_events: u64,
    pub proc_records: u64,
    pub lost_records: u64,
    /// Sum of the `count`s of the lost records.
    pub lost_events: u64,
    /// Blocks in the file, the one holding this trailer included.
    pub blocks: u64,
}

/// The fixed-size header in front of each block's payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockHeader {
    pub seq: u32,
    pub records: u32,
    pub raw_len: u32,
    pub stored_len: u32,
    pub compression: u8,
    pub payload_crc: u32,
}

impl BlockHeader {
    pub fn encode(&self) -> [u8; BLOCK_HEADER_LEN] {
        let mut b = [0u8; BLOCK_HEADER_LEN];
        b[0..4].copy_from_slice(&BLOCK_MAGIC);
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.records.to_le_bytes());
        b[12..16].copy_from_slice(&self.raw_len.to_le_bytes());
        b[16..20].copy_from_slice(&self.stored_len.to_le_bytes());
        b[20] = self.compression;
        // 21..24 reserved, zero.
        b[24..28].copy_from_slice(&self.payload_crc.to_le_bytes());
        let crc = crc32fast::hash(&b[..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// The stored header checksum and the one computed over bytes 0..28.
    pub fn checksums(b: &[u8; BLOCK_HEADER_LEN]) -> (u32, u32) {
        (le32(b, 28), crc32fast::hash(&b[..28]))
    }

    /// Fields of a header whose magic and checksum the caller has checked.
    pub fn decode(b: &[u8; BLOCK_HEADER_LEN]) -> Self {
        BlockHeader {
            seq: le32(b, 4),
            records: le32(b, 8),
            raw_len: le32(b, 12),
            stored_len: le32(b, 16),
            compression: b[20],
            payload_crc: le32(b, 24),
        }
    }
}

fn le32(b: &[u8; BLOCK_HEADER_LEN], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

/// The file header: prefix, JSON, CRC32 of both.
pub fn encode_file_header(header: &CaptureHeader) -> Result<Vec<u8>, serde_json::Error> {
    let json = serde_json::to_vec(header)?;
    let mut b = Vec::with_capacity(FILE_PREFIX_LEN + json.len() + 4);
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    // The writer checks the length against MAX_HEADER_JSON (which fits a u32) before this
    // matters; saturating keeps this function total.
    b.extend_from_slice(&u32::try_from(json.len()).unwrap_or(u32::MAX).to_le_bytes());
    b.extend_from_slice(&json);
    let crc = crc32fast::hash(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    Ok(b)
}

/// LEB128: 7 bits a byte, low bits first, high bit set on all bytes but the last.
#[inline]
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a varint at `*pos`, advancing it. `None` when it runs past `b` or past 64 bits.
#[inline]
pub fn get_varint(b: &[u8], pos: &mut usize) -> Option<u64> {
    // One byte (record lengths, most fields): small enough to inline everywhere.
    match b.get(*pos) {
        Some(&v) if v < 0x80 => {
            *pos += 1;
            Some(u64::from(v))
        }
        _ => get_varint_long(b, pos),
    }
}

fn get_varint_long(b: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v: u64 = 0;
    let mut shift = 0u32;
    loop {
        let byte = *b.get(*pos)?;
        *pos += 1;
        if shift == 63 && byte > 1 {
            return None;
        }
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
        shift += 7;
        if shift > 63 {
            return None;
        }
    }
}

/// An address: its family (4, 6), then its bytes.
/// An address as [`put_ip`] writes it, then its port (a varint).
fn put_sock(out: &mut Vec<u8>, a: std::net::SocketAddr) {
    put_ip(out, a.ip());
    put_varint(out, u64::from(a.port()));
}

fn put_ip(out: &mut Vec<u8>, a: std::net::IpAddr) {
    match a {
        std::net::IpAddr::V4(v) => {
            put_varint(out, 4);
            put_bytes(out, &v.octets());
        }
        std::net::IpAddr::V6(v) => {
            put_varint(out, 6);
            put_bytes(out, &v.octets());
        }
    }
}

fn small(v: u64, what: &'static str) -> Result<u8, String> {
    u8::try_from(v).map_err(|_| format!("{what}: {v} does not fit 8 bits"))
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// A cursor over one record body. Every getter fails with a short reason instead of panicking.
pub struct Body<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Body<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Body { b, pos: 0 }
    }

    pub fn varint(&mut self, what: &'static str) -> Result<u64, String> {
        get_varint(self.b, &mut self.pos).ok_or_else(|| format!("{what}: bad or missing varint"))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, String> {
        let v = self.varint(what)?;
        u32::try_from(v).map_err(|_| format!("{what}: {v} does not fit 32 bits"))
    }

    fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], String> {
        let len = self.varint(what)?;
        self.take(len, what)
    }

    /// The next `len` bytes.
    fn take(&mut self, len: u64, what: &'static str) -> Result<&'a [u8], String> {
        let left = self.b.len() - self.pos;
        // Compared as u64 first: a damaged length must never become a huge slice or allocation.
        if len > left as u64 {
            return Err(format!(
                "{what}: length {len} runs past the record's {left} remaining bytes"
            ));
        }
        let s = &self.b[self.pos..self.pos + len as usize];
        self.pos += len as usize;
        Ok(s)
    }

    /// An address and port as [`put_sock`] writes them.
    fn sock(&mut self, what: &'static str) -> Result<std::net::SocketAddr, String> {
        let ip = self.ip(what)?;
        let port =
            u16::try_from(self.varint(what)?).map_err(|_| format!("{what}: port out of range"))?;
        Ok(std::net::SocketAddr::new(ip, port))
    }

    /// An address as [`put_ip`] writes it: its family (4, 6), then its bytes.
    fn ip(&mut self, what: &'static str) -> Result<std::net::IpAddr, String> {
        let family = self.varint(what)?;
        let bytes = self.bytes(what)?;
        match family {
            4 => <[u8; 4]>::try_from(bytes).ok().map(std::net::IpAddr::from),
            6 => <[u8; 16]>::try_from(bytes).ok().map(std::net::IpAddr::from),
            _ => None,
        }
        .ok_or_else(|| {
            format!(
                "{what}: address of {} bytes for family {family}",
                bytes.len()
            )
        })
    }

    fn string(&mut self, what: &'static str) -> Result<String, String> {
        // Writers store valid UTF-8; lossy keeps a reader total if one did not.
        Ok(String::from_utf8_lossy(self.bytes(what)?).into_owned())
    }

    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }
}

/// Kind 2: `ts_ns, pid, ppid` varints, `comm` (length-prefixed, trailing NULs dropped),
/// `argc` then each argument length-prefixed, `has_cgroup` (0/1) then the cgroup path.
pub fn encode_proc(p: &ProcInfo, out: &mut Vec<u8>) {
    put_varint(out, p.ts_ns);
    put_varint(out, u64::from(p.pid));
    put_varint(out, u64::from(p.ppid));
    let comm_len = p.comm.0.iter().rposition(|&c| c != 0).map_or(0, |i| i + 1);
    put_bytes(out, &p.comm.0[..comm_len]);
    put_varint(out, p.argv.len() as u64);
    for a in &p.argv {
        put_bytes(out, a.as_bytes());
    }
    match &p.cgroup {
        None => put_varint(out, 0),
        Some(c) => {
            put_varint(out, 1);
            put_bytes(out, c.as_bytes());
        }
    }
    // Appended: older readers stop before it.
    if let Some(e) = &p.exe {
        put_bytes(out, e.path.as_bytes());
        put_bytes(out, e.version.as_deref().unwrap_or("").as_bytes());
    }
}

pub fn decode_proc(b: &[u8]) -> Result<ProcInfo, String> {
    let mut r = Body::new(b);
    let ts_ns = r.varint("ts_ns")?;
    let pid = r.u32("pid")?;
    let ppid = r.u32("ppid")?;
    let c = r.bytes("comm")?;
    let mut comm = Comm::default();
    if c.len() > comm.0.len() {
        return Err(format!(
            "comm of {} bytes, at most {}",
            c.len(),
            comm.0.len()
        ));
    }
    comm.0[..c.len()].copy_from_slice(c);
    let argc = r.varint("argc")?;
    // Each argument takes at least one byte: a count past that is damage, not a reason to
    // reserve memory.
    if argc > r.remaining() as u64 {
        return Err(format!(
            "argc {argc} exceeds the {} bytes left",
            r.remaining()
        ));
    }
    let mut argv = Vec::with_capacity(argc as usize);
    for _ in 0..argc {
        argv.push(r.string("argv")?);
    }
    let cgroup = match r.varint("has_cgroup")? {
        0 => None,
        1 => Some(r.string("cgroup")?),
        v => return Err(format!("has_cgroup is {v}, expected 0 or 1")),
    };
    // Appended later: the resolved program and its version (absent in older records).
    // Bytes that do not read as both are a newer writer's fields, not these: ignored.
    let exe = match (r.string("exe"), r.string("exe_version")) {
        (Ok(path), Ok(v)) if !path.is_empty() => Some(Box::new(crate::event::ExeInfo {
            path,
            version: (!v.is_empty()).then_some(v),
        })),
        _ => None,
    };
    // Bytes left over are fields a newer writer added: ignored.
    Ok(ProcInfo {
        ts_ns,
        pid,
        ppid,
        comm,
        argv,
        cgroup,
        exe,
    })
}

/// Kind 128 body of the kernel event `raw`, appended to `out`, when it pays: its zero runs
/// (those holding an 8-byte word of zeros, aligned to the event's start) add up to at least
/// [`SPARSE_MIN_ELIDED`] bytes and the body is shorter than `raw`. Returns `false` and leaves
/// `out` as it was otherwise: the event goes in a plain kind 1 record.
///
/// Body: `total` varint, then segments until `total` bytes are made: `literal` varint and as
/// many bytes, then (unless `total` is reached) `zeros` varint. LZ4 never sees the long NUL
/// runs of an exec event: it copies overlapping matches byte by byte, slowly, when reading.
pub fn encode_sparse_kernel(raw: &[u8], out: &mut Vec<u8>) -> bool {
    if raw.len() > MAX_SPARSE_KERNEL_LEN || raw.len() < SPARSE_MIN_ELIDED {
        return false;
    }
    // Only whether a word is zero matters, so the byte order does not.
    let zero_word = |at: usize| raw.get(at..at + 8).is_some_and(|w| w == [0u8; 8]);
    let start = out.len();
    put_varint(out, raw.len() as u64);
    // Start of the literal not written yet; next aligned word to look at.
    let (mut lit, mut at) = (0, 0);
    let mut elided = 0;
    while at + 8 <= raw.len() {
        if !zero_word(at) {
            at += 8;
            continue;
        }
        // Widen the run to its whole extent, bytes before and after the zero words.
        let mut zs = at;
        while zs > lit && raw[zs - 1] == 0 {
            zs -= 1;
        }
        let mut ze = at + 8;
        while zero_word(ze) {
            ze += 8;
        }
        while ze < raw.len() && raw[ze] == 0 {
            ze += 1;
        }
        put_varint(out, (zs - lit) as u64);
        out.extend_from_slice(&raw[lit..zs]);
        put_varint(out, (ze - zs) as u64);
        elided += ze - zs;
        lit = ze;
        // The word holding `raw[ze]` is not zero.
        at = (ze / 8 + 1) * 8;
    }
    if lit < raw.len() {
        put_varint(out, (raw.len() - lit) as u64);
        out.extend_from_slice(&raw[lit..]);
    }
    if elided < SPARSE_MIN_ELIDED || out.len() - start >= raw.len() {
        out.truncate(start);
        return false;
    }
    true
}

/// Expands a kind 128 body into `out[..n]` and returns `n`. `out` only grows (to at most
/// [`MAX_SPARSE_KERNEL_LEN`]), so a reader reusing it does not allocate per record.
pub fn expand_sparse_kernel(b: &[u8], out: &mut Vec<u8>) -> Result<usize, String> {
    let mut r = Body::new(b);
    let total = r.varint("total length")?;
    if total > MAX_SPARSE_KERNEL_LEN as u64 {
        return Err(format!(
            "sparse kernel event of {total} bytes, at most {MAX_SPARSE_KERNEL_LEN}"
        ));
    }
    let total = total as usize;
    if out.len() < total {
        out.resize(total, 0);
    }
    // One memset for all the runs beats one per run (an exec event has a dozen).
    out[..total].fill(0);
    let mut at = 0;
    while at < total {
        let lit = r.varint("literal length")?;
        if lit > (total - at) as u64 {
            return Err(format!(
                "literal of {lit} bytes at {at} runs past the total of {total}"
            ));
        }
        let bytes = r.take(lit, "literal")?;
        out[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
        if at == total {
            break;
        }
        let zeros = r.varint("zero run length")?;
        if zeros > (total - at) as u64 {
            return Err(format!(
                "zero run of {zeros} bytes at {at} runs past the total of {total}"
            ));
        }
        at += zeros as usize;
    }
    if r.remaining() != 0 {
        return Err(format!(
            "{} bytes after the last segment of a sparse kernel event",
            r.remaining()
        ));
    }
    Ok(total)
}

/// Kind 3: `ts_ns, count` varints.
pub fn encode_lost(ts_ns: u64, count: u64, out: &mut Vec<u8>) {
    put_varint(out, ts_ns);
    put_varint(out, count);
}

pub fn decode_lost(b: &[u8]) -> Result<(u64, u64), String> {
    let mut r = Body::new(b);
    Ok((r.varint("ts_ns")?, r.varint("count")?))
}

/// The record kind and body of a synthetic event of kinds 5..=18 (drop and refusal records,
/// lock seeds, pods, rule tables and counters, addresses, conntrack entries, IPVS tables);
/// `None` for any other event.
pub fn encode_synthetic(ev: &Event, out: &mut Vec<u8>) -> Option<u8> {
    Some(match ev {
        Event::DropSetup {
            ts_ns,
            has_reason,
            host_netns,
            names,
        } => {
            encode_drop_setup(*ts_ns, *has_reason, *host_netns, names, out);
            KIND_DROP_SETUP
        }
        Event::KernelSymbol {
            ts_ns,
            addr,
            name,
            offset,
        } => {
            encode_kernel_symbol(*ts_ns, *addr, name, *offset, out);
            KIND_KERNEL_SYMBOL
        }
        Event::DropCounts(c) => {
            encode_drop_counts(c, out);
            KIND_DROP_COUNTS
        }
        Event::Conntrack(c) => {
            encode_conntrack(c, out);
            KIND_CONNTRACK
        }
        Event::LockSeed(l) => {
            encode_lock_seed(l, out);
            KIND_LOCK_SEED
        }
        Event::IpvsCounts(c) => {
            encode_ipvs_counts(c, out);
            KIND_IPVS_COUNTS
        }
        Event::Pod(p) => {
            encode_pod(p, out);
            KIND_POD
        }
        Event::RuleTable(t) => {
            encode_rule_table(t, out);
            KIND_RULE_TABLE
        }
        Event::RefusalCounts(c) => {
            encode_refusal_counts(c, out);
            KIND_REFUSAL_COUNTS
        }
        Event::Addr(a) if matches!(a.why, AddrWhy::Unanswered | AddrWhy::Answering) => {
            encode_endpoint_answers(a, out);
            KIND_ENDPOINT_ANSWERS
        }
        Event::Addr(a) => {
            encode_addr(a, out);
            KIND_ADDR
        }
        Event::IpvsTable(t) => {
            encode_ipvs_table(t, out);
            KIND_IPVS_TABLE
        }
        Event::RuleCounters(c) => {
            encode_rule_counters(c, out);
            KIND_RULE_COUNTERS
        }
        Event::CtEntries(c) => {
            encode_ct_entries(c, out);
            KIND_CT_ENTRIES
        }
        _ => return None,
    })
}

/// Kind 5: the recording kernel's drop-reason names.
fn encode_drop_setup(
    ts_ns: u64,
    has_reason: bool,
    host_netns: u32,
    names: &[(u32, String)],
    out: &mut Vec<u8>,
) {
    put_varint(out, ts_ns);
    put_varint(out, u64::from(has_reason));
    put_varint(out, u64::from(host_netns));
    put_varint(out, names.len() as u64);
    for (code, name) in names {
        put_varint(out, u64::from(*code));
        put_bytes(out, name.as_bytes());
    }
}

/// Kind 6: the kernel function a drop location is in.
fn encode_kernel_symbol(ts_ns: u64, addr: u64, name: &str, offset: u64, out: &mut Vec<u8>) {
    put_varint(out, ts_ns);
    put_varint(out, addr);
    put_varint(out, offset);
    put_bytes(out, name.as_bytes());
}

/// Kind 7: exact drop counts of one interval, per hold and reason.
fn encode_drop_counts(c: &DropCounts, out: &mut Vec<u8>) {
    put_varint(out, c.ts_ns);
    put_varint(out, c.interval_ns);
    put_varint(out, c.overflow);
    put_varint(out, c.counts.len() as u64);
    for d in &c.counts {
        put_varint(out, d.location);
        put_varint(out, u64::from(d.reason));
        put_varint(out, u64::from(d.netns));
        put_varint(out, d.count);
    }
    // Appended in format 1 as it was: older readers stop before it.
    put_varint(out, c.holds.len() as u64);
    for h in &c.holds {
        put_varint(out, h.start_ns);
        put_varint(out, h.count);
    }
    // Then each hold's reasons, in the same order (appended later still: readers of
    // the per-hold counts alone stop before them).
    for h in &c.holds {
        put_varint(out, h.by_reason.len() as u64);
        for &(reason, n) in &h.by_reason {
            put_varint(out, u64::from(reason));
            put_varint(out, n);
        }
    }
}

/// Kind 8: conntrack statistics deltas of one namespace.
fn encode_conntrack(c: &ConntrackStats, out: &mut Vec<u8>) {
    for v in [
        c.ts_ns,
        c.interval_ns,
        u64::from(c.netns),
        c.count,
        c.max,
        c.deltas.drop,
        c.deltas.early_drop,
        c.deltas.insert_failed,
        c.deltas.invalid,
        c.deltas.search_restart,
        c.deltas.clash_resolve,
        c.deltas.chaintoolong,
    ] {
        put_varint(out, v);
    }
}

/// Kind 9: a flock held on a watched lock when recording began.
fn encode_lock_seed(l: &LockSeed, out: &mut Vec<u8>) {
    for v in [
        l.ts_ns,
        u64::from(l.pid),
        u64::from(l.dev),
        l.ino,
        u64::from(l.exclusive),
    ] {
        put_varint(out, v);
    }
}

/// Kind 10: exact IPVS packet counts of one interval.
fn encode_ipvs_counts(c: &IpvsCounts, out: &mut Vec<u8>) {
    put_varint(out, c.ts_ns);
    put_varint(out, c.interval_ns);
    put_varint(out, c.overflow);
    put_varint(out, c.counts.len() as u64);
    for d in &c.counts {
        let (af, vaddr, vport) = inet_parts(&d.service);
        let (_, daddr, dport) = inet_parts(&d.backend);
        put_varint(out, u64::from(af));
        put_varint(out, u64::from(d.protocol));
        put_varint(out, d.state as u64);
        put_bytes(out, &vaddr[..addr_len(af)]);
        put_varint(out, u64::from(vport));
        put_bytes(out, &daddr[..addr_len(af)]);
        put_varint(out, u64::from(dport));
        put_varint(out, d.count);
    }
}

/// Kind 11: the kubelet's names of a container or pod.
fn encode_pod(p: &crate::decode::PodInfo, out: &mut Vec<u8>) {
    put_varint(out, p.ts_ns);
    for s in [
        &p.container_id,
        &p.pod_uid,
        &p.namespace,
        &p.pod,
        &p.container,
    ] {
        put_bytes(out, s.as_bytes());
    }
}

/// Kind 13: a table read back after a write.
fn encode_rule_table(t: &crate::event::RuleTable, out: &mut Vec<u8>) {
    put_varint(out, t.ts_ns);
    put_varint(out, u64::from(t.netns));
    put_varint(out, u64::from(t.after_pid));
    for s in [&t.family, &t.table, &t.skipped] {
        put_bytes(out, s.as_bytes());
    }
    put_varint(out, t.chains.len() as u64);
    for c in &t.chains {
        put_bytes(out, c.name.as_bytes());
        // The policy with a presence flag: `""` is not "no policy".
        put_varint(out, u64::from(c.policy.is_some()));
        put_bytes(out, c.policy.as_deref().unwrap_or("").as_bytes());
        put_varint(out, c.digest);
        match &c.rules {
            None => put_varint(out, 0),
            Some(rules) => {
                put_varint(out, rules.len() as u64 + 1);
                for r in rules {
                    put_varint(out, r.0.len() as u64);
                    for part in &r.0 {
                        put_bytes(out, part.as_bytes());
                    }
                }
            }
        }
    }
    // Appended: older records end before it (read as the whole table).
    put_varint(out, u64::from(t.more));
}

/// Kind 12: exact refusal counts of one interval, and the kernel's reset reason names.
fn encode_refusal_counts(c: &RefusalCounts, out: &mut Vec<u8>) {
    put_varint(out, c.ts_ns);
    put_varint(out, c.interval_ns);
    put_varint(out, c.overflow);
    put_varint(out, c.counts.len() as u64);
    for d in &c.counts {
        let (family, addr): (u8, Vec<u8>) = match d.addr {
            Some(std::net::IpAddr::V4(a)) => (4, a.octets().to_vec()),
            Some(std::net::IpAddr::V6(a)) => (6, a.octets().to_vec()),
            None => (0, Vec::new()),
        };
        put_varint(out, d.hold_start_ns);
        put_varint(out, u64::from(d.netns));
        put_varint(out, u64::from(d.kind));
        put_varint(out, u64::from(d.detail));
        put_varint(out, u64::from(family));
        put_bytes(out, &addr);
        put_varint(out, u64::from(d.port));
        put_varint(out, d.count);
    }
    put_varint(out, c.reset_reasons.len() as u64);
    for (code, name) in &c.reset_reasons {
        put_varint(out, u64::from(*code));
        put_bytes(out, name.as_bytes());
    }
}

/// Kind 16: an endpoint whose connections went unanswered, or that answers again.
fn encode_endpoint_answers(a: &crate::event::AddrPresence, out: &mut Vec<u8>) {
    put_varint(out, a.ts_ns);
    put_varint(out, u64::from(a.netns));
    put_ip(out, a.addr);
    put_varint(out, u64::from(a.why == AddrWhy::Answering));
}

/// Kind 14: an address that appeared on or vanished from the node.
fn encode_addr(a: &crate::event::AddrPresence, out: &mut Vec<u8>) {
    put_varint(out, a.ts_ns);
    put_varint(out, u64::from(a.netns));
    let (family, addr): (u8, Vec<u8>) = match a.addr {
        std::net::IpAddr::V4(v) => (4, v.octets().to_vec()),
        std::net::IpAddr::V6(v) => (6, v.octets().to_vec()),
    };
    put_varint(out, u64::from(family));
    put_bytes(out, &addr);
    put_varint(out, u64::from(a.why.code()));
    put_bytes(out, a.link.as_bytes());
    // Appended (readers skip trailing bytes): bit 0, said live.
    put_varint(out, u64::from(a.live));
}

/// Kind 17: a namespace's IPVS virtual and real servers, capped.
fn encode_ipvs_table(t: &crate::event::IpvsTable, out: &mut Vec<u8>) {
    put_varint(out, t.ts_ns);
    put_varint(out, u64::from(t.netns));
    let services = &t.services[..t.services.len().min(MAX_IPVS_SERVICES as usize)];
    put_varint(out, services.len() as u64);
    let mut dests_left = MAX_IPVS_DESTS as usize;
    for svc in services {
        put_varint(out, u64::from(svc.proto));
        match svc.addr {
            Some(a) => {
                put_varint(out, 1);
                put_sock(out, a);
            }
            None => {
                put_varint(out, 0);
                put_varint(out, u64::from(svc.fwmark));
            }
        }
        let dests = &svc.dests[..svc.dests.len().min(dests_left)];
        dests_left -= dests.len();
        put_varint(out, dests.len() as u64);
        for d in dests {
            put_sock(out, d.addr);
            put_varint(out, u64::from(d.weight));
            put_varint(out, u64::from(d.active));
            put_varint(out, u64::from(d.inactive));
        }
    }
}

/// Kind 15: the conntrack entries DNATed to an address gone from the node, capped.
fn encode_ct_entries(c: &crate::event::CtEntries, out: &mut Vec<u8>) {
    put_varint(out, c.ts_ns);
    put_varint(out, u64::from(c.netns));
    put_ip(out, c.addr);
    put_varint(out, u64::from(c.more));
    let n = c.entries.len().min(MAX_CT_ENTRIES as usize);
    put_varint(out, n as u64);
    for e in &c.entries[..n] {
        put_varint(out, u64::from(e.id));
        put_varint(out, u64::from(e.proto));
        put_varint(out, u64::from(e.tcp_state));
        put_varint(out, u64::from(e.status));
        for a in [e.orig_src, e.orig_dst, e.reply_src] {
            put_sock(out, a);
        }
        put_varint(out, e.packets);
        put_varint(out, u64::from(e.timeout_s));
    }
}

/// Kind 18's body: the read's times, table, then each moved rule and the uncounted ones.
fn encode_rule_counters(c: &crate::event::RuleCounters, out: &mut Vec<u8>) {
    put_varint(out, c.ts_ns);
    put_varint(out, c.since_ns);
    put_varint(out, u64::from(c.netns));
    put_bytes(out, c.family.as_bytes());
    put_bytes(out, c.table.as_bytes());
    let rules = &c.rules[..c.rules.len().min(crate::event::MAX_RULE_COUNTS)];
    put_varint(out, rules.len() as u64);
    for r in rules {
        put_bytes(out, r.chain.as_bytes());
        put_bytes(out, r.rule.as_bytes());
        put_varint(out, u64::from(r.nth));
        put_varint(out, r.packets);
        put_varint(out, r.bytes);
        put_varint(out, u64::from(r.reset));
    }
    let uncounted = &c.uncounted[..c.uncounted.len().min(crate::event::MAX_UNCOUNTED)];
    put_varint(out, uncounted.len() as u64);
    for u in uncounted {
        put_bytes(out, u.as_bytes());
    }
}

/// Kind 18's body back; counts past the event's bounds are damage.
fn decode_rule_counters(r: &mut Body<'_>) -> Result<Event, String> {
    let ts_ns = r.varint("ts_ns")?;
    let since_ns = r.varint("since_ns")?;
    let netns = r.u32("netns")?;
    let family = r.string("family")?;
    let table = r.string("table")?;
    let n = r.varint("rules")?;
    if n > crate::event::MAX_RULE_COUNTS as u64 {
        return Err(format!(
            "{n} rule counts, more than {}",
            crate::event::MAX_RULE_COUNTS
        ));
    }
    let mut rules = Vec::with_capacity((n as usize).min(r.remaining()));
    for _ in 0..n {
        rules.push(crate::event::RuleCount {
            chain: r.string("chain")?,
            rule: r.string("rule")?,
            nth: r.u32("nth")?,
            packets: r.varint("packets")?,
            bytes: r.varint("bytes")?,
            reset: match r.varint("reset")? {
                0 => false,
                1 => true,
                v => return Err(format!("reset is {v}, not 0 or 1")),
            },
        });
    }
    let n = r.varint("uncounted")?;
    if n > crate::event::MAX_UNCOUNTED as u64 {
        return Err(format!(
            "{n} uncounted rules, more than {}",
            crate::event::MAX_UNCOUNTED
        ));
    }
    let mut uncounted = Vec::with_capacity(n as usize);
    for _ in 0..n {
        uncounted.push(r.string("uncounted rule")?);
    }
    Ok(Event::RuleCounters(Box::new(crate::event::RuleCounters {
        ts_ns,
        since_ns,
        netns,
        family,
        table,
        rules,
        uncounted,
    })))
}

/// Decodes a body of kind 5..=18 into its event; trailing fields are ignored.
pub fn decode_synthetic(kind: u8, b: &[u8]) -> Result<Event, String> {
    decode_synthetic_with(kind, b, &mut ChainNames::default())
}

/// [`decode_synthetic`], with the chain names of the reader's earlier rule-table reads to
/// share (the same event, fewer allocations).
pub fn decode_synthetic_with(kind: u8, b: &[u8], names: &mut ChainNames) -> Result<Event, String> {
    let mut r = Body::new(b);
    Ok(match kind {
        KIND_DROP_SETUP => decode_drop_setup(&mut r)?,
        KIND_KERNEL_SYMBOL => decode_kernel_symbol(&mut r)?,
        KIND_DROP_COUNTS => decode_drop_counts(&mut r)?,
        KIND_CONNTRACK => decode_conntrack(&mut r)?,
        KIND_IPVS_COUNTS => decode_ipvs_counts(&mut r)?,
        KIND_LOCK_SEED => decode_lock_seed(&mut r)?,
        KIND_POD => decode_pod(&mut r)?,
        KIND_RULE_TABLE => decode_rule_table(&mut r, names)?,
        KIND_REFUSAL_COUNTS => decode_refusal_counts(&mut r)?,
        KIND_ADDR => decode_addr(&mut r)?,
        KIND_ENDPOINT_ANSWERS => decode_endpoint_answers(&mut r)?,
        KIND_IPVS_TABLE => decode_ipvs_table(&mut r)?,
        KIND_RULE_COUNTERS => decode_rule_counters(&mut r)?,
        KIND_CT_ENTRIES => decode_ct_entries(&mut r)?,
        k => return Err(format!("kind {k} is not a synthetic record")),
    })
}

/// Kind 5: the recording kernel's drop-reason names.
fn decode_drop_setup(r: &mut Body<'_>) -> Result<Event, String> {
    let ts_ns = r.varint("ts_ns")?;
    let has_reason = r.varint("has_reason")? != 0;
    let host_netns = r.u32("host_netns")?;
    let n = r.varint("reasons")?;
    if n > r.remaining() as u64 {
        return Err(format!(
            "{n} reasons exceed the {} bytes left",
            r.remaining()
        ));
    }
    let mut names = Vec::with_capacity(n as usize);
    for _ in 0..n {
        names.push((r.u32("reason")?, r.string("reason name")?));
    }
    Ok(Event::DropSetup {
        ts_ns,
        has_reason,
        host_netns,
        names,
    })
}

/// Kind 6: the kernel function a drop location is in.
fn decode_kernel_symbol(r: &mut Body<'_>) -> Result<Event, String> {
    Ok(Event::KernelSymbol {
        ts_ns: r.varint("ts_ns")?,
        addr: r.varint("addr")?,
        offset: r.varint("offset")?,
        name: r.string("name")?,
    })
}

/// Kind 7: exact drop counts of one interval, per hold and reason where recorded.
fn decode_drop_counts(r: &mut Body<'_>) -> Result<Event, String> {
    let ts_ns = r.varint("ts_ns")?;
    let interval_ns = r.varint("interval_ns")?;
    let overflow = r.varint("overflow")?;
    let n = r.varint("counts")?;
    // Each count takes at least four bytes.
    if n > r.remaining() as u64 / 4 {
        return Err(format!(
            "{n} counts exceed the {} bytes left",
            r.remaining()
        ));
    }
    let mut counts = Vec::with_capacity(n as usize);
    for _ in 0..n {
        counts.push(DropCount {
            location: r.varint("location")?,
            reason: r.u32("reason")?,
            netns: r.u32("netns")?,
            count: r.varint("count")?,
        });
    }
    // Per-hold counts, absent in captures from before they existed.
    let mut holds = Vec::new();
    if r.remaining() > 0 {
        let n = r.varint("holds")?;
        if n > r.remaining() as u64 / 2 {
            return Err(format!(
                "{n} hold counts exceed the {} bytes left",
                r.remaining()
            ));
        }
        holds.reserve(n as usize);
        for _ in 0..n {
            holds.push(HoldDropCount {
                start_ns: r.varint("start_ns")?,
                count: r.varint("count")?,
                by_reason: Vec::new(),
            });
        }
    }
    // Each hold's drops per reason, absent in captures from before they were counted.
    if r.remaining() > 0 {
        for h in &mut holds {
            let k = r.varint("hold reasons")?;
            if k > r.remaining() as u64 / 2 {
                return Err(format!(
                    "{k} hold reasons exceed the {} bytes left",
                    r.remaining()
                ));
            }
            for _ in 0..k {
                h.by_reason
                    .push((r.u32("hold reason")?, r.varint("hold reason count")?));
            }
        }
    }
    Ok(Event::DropCounts(DropCounts {
        ts_ns,
        interval_ns,
        counts,
        overflow,
        holds,
    }))
}

/// Kind 8: conntrack statistics deltas of one namespace.
fn decode_conntrack(r: &mut Body<'_>) -> Result<Event, String> {
    Ok(Event::Conntrack(Box::new(ConntrackStats {
        ts_ns: r.varint("ts_ns")?,
        interval_ns: r.varint("interval_ns")?,
        netns: r.u32("netns")?,
        count: r.varint("count")?,
        max: r.varint("max")?,
        deltas: ConntrackCounters {
            drop: r.varint("drop")?,
            early_drop: r.varint("early_drop")?,
            insert_failed: r.varint("insert_failed")?,
            invalid: r.varint("invalid")?,
            search_restart: r.varint("search_restart")?,
            clash_resolve: r.varint("clash_resolve")?,
            chaintoolong: r.varint("chaintoolong")?,
        },
    })))
}

/// Kind 10: exact IPVS packet counts of one interval.
fn decode_ipvs_counts(r: &mut Body<'_>) -> Result<Event, String> {
    let ts_ns = r.varint("ts_ns")?;
    let interval_ns = r.varint("interval_ns")?;
    let overflow = r.varint("overflow")?;
    let n = r.varint("counts")?;
    // Each count takes at least 16 bytes.
    if n > r.remaining() as u64 / 16 {
        return Err(format!(
            "{n} counts exceed the {} bytes left",
            r.remaining()
        ));
    }
    let mut counts = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let af = r.u32("af")? as u16;
        let protocol = r.u32("protocol")? as u8;
        let state = r.u32("state")? as u8;
        let vaddr = addr_from(af, r.bytes("vaddr")?)?;
        let vport = r.u32("vport")? as u16;
        let daddr = addr_from(af, r.bytes("daddr")?)?;
        let dport = r.u32("dport")? as u16;
        let count = r.varint("count")?;
        counts.push(crate::decode::ipvs_count(
            &xtlock_common::IpvsKey {
                vaddr,
                daddr,
                vport,
                dport,
                af,
                protocol,
                state,
            },
            count,
        ));
    }
    Ok(Event::IpvsCounts(IpvsCounts {
        ts_ns,
        interval_ns,
        counts,
        overflow,
    }))
}

/// Kind 9: a flock held on a watched lock when recording began.
fn decode_lock_seed(r: &mut Body<'_>) -> Result<Event, String> {
    Ok(Event::LockSeed(LockSeed {
        ts_ns: r.varint("ts_ns")?,
        pid: r.u32("pid")?,
        dev: r.u32("dev")?,
        ino: r.varint("ino")?,
        exclusive: r.varint("exclusive")? != 0,
    }))
}

/// Kind 11: the kubelet's names of a container or pod.
fn decode_pod(r: &mut Body<'_>) -> Result<Event, String> {
    Ok(Event::Pod(Box::new(crate::decode::PodInfo {
        ts_ns: r.varint("ts_ns")?,
        container_id: r.string("container_id")?,
        pod_uid: r.string("pod_uid")?,
        namespace: r.string("namespace")?,
        pod: r.string("pod")?,
        container: r.string("container")?,
    })))
}

/// Kind 13: a table read back after a write, its chain names shared with earlier reads.
fn decode_rule_table(r: &mut Body<'_>, names: &mut ChainNames) -> Result<Event, String> {
    let (ts_ns, netns, after_pid) = (r.varint("ts_ns")?, r.u32("netns")?, r.u32("pid")?);
    let (family, table, skipped) = (
        r.string("family")?,
        r.string("table")?,
        r.string("skipped")?,
    );
    let n = r.varint("chains")?;
    let mut read = names.read(netns, &family, &table, ts_ns);
    // A chain takes at least five bytes: a damaged count allocates nothing more.
    let mut chains = Vec::with_capacity(n.min(r.remaining() as u64 / 5) as usize);
    for _ in 0..n {
        let name = read.name(r.bytes("chain")?);
        let has_policy = r.varint("has policy")? != 0;
        let policy = r.bytes("policy")?;
        let policy = has_policy.then(|| read.policy(policy));
        let digest = r.varint("digest")?;
        let rules = match r.varint("rules")? {
            0 => None,
            k => {
                let mut rules = Vec::new();
                for _ in 1..k {
                    let parts = r.varint("parts")?;
                    let mut v = Vec::new();
                    for _ in 0..parts {
                        v.push(r.string("part")?);
                    }
                    rules.push(crate::event::Rule(v));
                }
                Some(rules)
            }
        };
        chains.push(crate::event::ChainState {
            name,
            policy,
            digest,
            rules,
        });
    }
    let more = r.remaining() > 0 && r.varint("more")? != 0;
    read.done(more);
    Ok(Event::RuleTable(Box::new(crate::event::RuleTable {
        ts_ns,
        netns,
        family,
        table,
        after_pid,
        skipped,
        chains,
        more,
    })))
}

/// Kind 12: exact refusal counts of one interval.
fn decode_refusal_counts(r: &mut Body<'_>) -> Result<Event, String> {
    let ts_ns = r.varint("ts_ns")?;
    let interval_ns = r.varint("interval_ns")?;
    let overflow = r.varint("overflow")?;
    let n = r.varint("counts")?;
    // Each count takes at least eight bytes.
    if n > r.remaining() as u64 / 8 {
        return Err(format!(
            "{n} counts exceed the {} bytes left",
            r.remaining()
        ));
    }
    let mut counts = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let hold_start_ns = r.varint("hold_start_ns")?;
        let netns = r.u32("netns")?;
        let kind = r.u32("kind")? as u8;
        let detail = r.u32("detail")?;
        let family = r.u32("family")? as u8;
        let bytes = r.bytes("addr")?;
        let addr = match (family, bytes.len()) {
            (0, 0) => None,
            (4, 4) | (6, 16) => {
                let mut a = [0u8; 16];
                a[..bytes.len()].copy_from_slice(bytes);
                crate::decode::ip_addr(family, &a)
            }
            (f, l) => return Err(format!("address of {l} bytes for family {f}")),
        };
        counts.push(RefusalCount {
            hold_start_ns,
            netns,
            kind,
            detail,
            addr,
            port: r.u32("port")? as u16,
            count: r.varint("count")?,
        });
    }
    let n = r.varint("reset reasons")?;
    if n > r.remaining() as u64 {
        return Err(format!(
            "{n} reset reasons exceed the {} bytes left",
            r.remaining()
        ));
    }
    let mut reset_reasons = Vec::with_capacity(n as usize);
    for _ in 0..n {
        reset_reasons.push((r.u32("reason")?, r.string("reason name")?));
    }
    Ok(Event::RefusalCounts(RefusalCounts {
        ts_ns,
        interval_ns,
        counts,
        overflow,
        reset_reasons,
    }))
}

/// Kind 14: an address that appeared on or vanished from the node.
fn decode_addr(r: &mut Body<'_>) -> Result<Event, String> {
    let ts_ns = r.varint("ts_ns")?;
    let netns = r.u32("netns")?;
    let family = r.varint("family")?;
    let bytes = r.bytes("addr")?;
    let addr = match family {
        4 => <[u8; 4]>::try_from(bytes).ok().map(std::net::IpAddr::from),
        6 => <[u8; 16]>::try_from(bytes).ok().map(std::net::IpAddr::from),
        _ => None,
    }
    .ok_or_else(|| format!("address of {} bytes for family {family}", bytes.len()))?;
    let code = r.varint("why")?;
    let why = u8::try_from(code)
        .ok()
        .and_then(AddrWhy::from_code)
        // Kind 16's reasons are not kind 14's.
        .filter(|w| !matches!(w, AddrWhy::Unanswered | AddrWhy::Answering))
        .ok_or_else(|| format!("unknown address reason {code}"))?;
    let link = r.string("link")?;
    // Captures before the flags byte: not known live, so no latency is made of it.
    let live = r.remaining() > 0 && r.varint("flags")? & 1 != 0;
    Ok(Event::Addr(Box::new(crate::event::AddrPresence {
        ts_ns,
        netns,
        addr,
        why,
        link,
        live,
    })))
}

/// Kind 16: an endpoint whose connections went unanswered, or that answers again.
fn decode_endpoint_answers(r: &mut Body<'_>) -> Result<Event, String> {
    let ts_ns = r.varint("ts_ns")?;
    let netns = r.u32("netns")?;
    let addr = r.ip("addr")?;
    let why = match r.varint("answering")? {
        0 => AddrWhy::Unanswered,
        1 => AddrWhy::Answering,
        n => return Err(format!("answering is {n}, not 0 or 1")),
    };
    Ok(Event::Addr(Box::new(crate::event::AddrPresence {
        ts_ns,
        netns,
        addr,
        why,
        link: String::new(),
        live: true,
    })))
}

/// Kind 17: a namespace's IPVS virtual and real servers.
fn decode_ipvs_table(r: &mut Body<'_>) -> Result<Event, String> {
    let ts_ns = r.varint("ts_ns")?;
    let netns = r.u32("netns")?;
    let n = r.varint("services")?;
    if n > MAX_IPVS_SERVICES {
        return Err(format!("{n} IPVS services, more than {MAX_IPVS_SERVICES}"));
    }
    // Each takes bytes: a count past what is left is damage, not an allocation.
    let mut services = Vec::with_capacity((n as usize).min(r.remaining()));
    let mut dests_left = MAX_IPVS_DESTS;
    for _ in 0..n {
        let proto = small(r.varint("proto")?, "proto")?;
        let (addr, fwmark) = match r.varint("has_addr")? {
            1 => (Some(r.sock("service")?), 0),
            0 => (None, r.u32("fwmark")?),
            v => return Err(format!("has_addr is {v}, not 0 or 1")),
        };
        let m = r.varint("dests")?;
        if m > dests_left {
            return Err(format!("more than {MAX_IPVS_DESTS} IPVS real servers"));
        }
        dests_left -= m;
        let mut dests = Vec::with_capacity((m as usize).min(r.remaining()));
        for _ in 0..m {
            dests.push(crate::event::IpvsDest {
                addr: r.sock("real server")?,
                weight: r.u32("weight")?,
                active: r.u32("active")?,
                inactive: r.u32("inactive")?,
            });
        }
        services.push(crate::event::IpvsService {
            proto,
            addr,
            fwmark,
            dests,
        });
    }
    Ok(Event::IpvsTable(Box::new(crate::event::IpvsTable {
        ts_ns,
        netns,
        services,
    })))
}

/// Kind 15: the conntrack entries DNATed to an address gone from the node.
fn decode_ct_entries(r: &mut Body<'_>) -> Result<Event, String> {
    let ts_ns = r.varint("ts_ns")?;
    let netns = r.u32("netns")?;
    let addr = r.ip("addr")?;
    let more = r.u32("more")?;
    let n = r.varint("entries")?;
    if n > MAX_CT_ENTRIES {
        return Err(format!("{n} conntrack entries, more than {MAX_CT_ENTRIES}"));
    }
    let mut entries = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let mut e = crate::event::CtEntry {
            id: r.u32("id")?,
            proto: small(r.varint("proto")?, "proto")?,
            tcp_state: small(r.varint("tcp_state")?, "tcp_state")?,
            status: r.u32("status")?,
            ..Default::default()
        };
        e.orig_src = r.sock("orig_src")?;
        e.orig_dst = r.sock("orig_dst")?;
        e.reply_src = r.sock("reply_src")?;
        e.packets = r.varint("packets")?;
        e.timeout_s = r.u32("timeout")?;
        entries.push(e);
    }
    Ok(Event::CtEntries(Box::new(crate::event::CtEntries {
        ts_ns,
        netns,
        addr,
        entries,
        more,
    })))
}

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

fn addr_len(af: u16) -> usize {
    if af == AF_INET6 {
        16
    } else {
        4
    }
}

/// (af, `union nf_inet_addr` bytes, port) of a socket address.
fn inet_parts(a: &std::net::SocketAddr) -> (u16, [u8; 16], u16) {
    let mut b = [0u8; 16];
    match a.ip() {
        std::net::IpAddr::V4(v) => {
            b[..4].copy_from_slice(&v.octets());
            (AF_INET, b, a.port())
        }
        std::net::IpAddr::V6(v) => (AF_INET6, v.octets(), a.port()),
    }
}

fn addr_from(af: u16, bytes: &[u8]) -> Result<[u8; 16], String> {
    let mut b = [0u8; 16];
    if bytes.len() != addr_len(af) {
        return Err(format!("address of {} bytes for family {af}", bytes.len()));
    }
    b[..bytes.len()].copy_from_slice(bytes);
    Ok(b)
}

/// Kind 4: the `Trailer` fields as varints, in declaration order.
pub fn encode_trailer(t: &Trailer, out: &mut Vec<u8>) {
    for v in [
        t.kernel_events,
        t.proc_records,
        t.lost_records,
        t.lost_events,
        t.blocks,
    ] {
        put_varint(out, v);
    }
}

pub fn decode_trailer(b: &[u8]) -> Result<Trailer, String> {
    let mut r = Body::new(b);
    Ok(Trailer {
        kernel_events: r.varint("kernel_events")?,
        proc_records: r.varint("proc_records")?,
        lost_records: r.varint("lost_records")?,
        lost_events: r.varint("lost_events")?,
        blocks: r.varint("blocks")?,
    })
}

mod names;
pub use names::ChainNames;

#[cfg(test)]
mod tests;
