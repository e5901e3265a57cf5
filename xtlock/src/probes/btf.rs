//! A small reader of the kernel's BTF (`/sys/kernel/btf/vmlinux`): struct member offsets and
//! enum values of the running kernel, so the drop probe reads `sk_buff`, `net_device`, `net`
//! and `sock` members where this kernel has them instead of where one kernel had them.
//!
//! Only what xtlock needs: types are indexed by id, structs and unions are walked by member
//! name (through anonymous members, which hold many `sk_buff` fields), typedefs and
//! qualifiers are skipped, and enums are listed. Never panics on any input.
//!
//! Kept rather than replaced by a crate (issue 32; measured with `examples/bench_btf.rs`,
//! docs/performance.md *Findings* 21). On a 6.18 vmlinux (5.5 MB), the lookups a start
//! makes cost 15 ms of CPU and at most 12 MiB with this reader, 167 ms and 41 MiB with
//! btf-rs 2.0 (its default cache backend; its mmap backend: 69 ms), and btf-rs would add
//! about 81 KB to the stripped binary, under a licence (LGPL-2.1-or-later) the static
//! binary's MIT/Apache-2.0 does not carry. Member paths through anonymous members, sizes,
//! C spellings and prototype checks would stay this code with either crate. aya-obj 0.3
//! (already linked, through aya) reads no split BTF and exposes no type by id or member.

use std::path::Path;

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
const HEADER_MIN: usize = 24;

const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_FWD: u32 = 7;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC: u32 = 12;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_FLOAT: u32 = 16;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BtfError {
    #[error("reading {path}: {why}")]
    Read { path: String, why: String },
    #[error("not BTF data: {0}")]
    Malformed(String),
    #[error("no struct {0} in the kernel's BTF")]
    NoStruct(String),
    #[error("struct {strukt} has no member {member}")]
    NoMember { strukt: String, member: String },
    #[error("{0} is a bitfield: not readable by byte offset")]
    Bitfield(String),
}

/// A parameter or return type, as a prototype check compares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArgType {
    /// A pointer to the struct or union of this name (empty: to anything else).
    Ptr(String),
    /// A pointer to a struct or union this BTF only declares (`struct pt_regs;`): kprobes
    /// read it as well, the verifier refuses fentry reads through it (Linux 5.10).
    FwdPtr(String),
    /// An integer, enum or bool of this many bytes.
    Int(u32),
    Void,
    /// Anything else, in C words.
    Other(String),
}

/// A function's prototype from BTF: each parameter's type and C spelling, and the return's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuncProto {
    pub params: Vec<(ArgType, String)>,
    pub ret: (ArgType, String),
}

/// One parsed type: where its record starts and its decoded header.
#[derive(Clone, Copy, Debug)]
struct Type {
    /// Offset of the type's extra data (after the 12-byte common header).
    extra: usize,
    name_off: u32,
    kind: u32,
    vlen: u32,
    kind_flag: bool,
    /// `size` (struct/union/enum/int) or `type` (ptr/typedef/qualifiers/...).
    size_or_type: u32,
}

/// Parsed BTF: the raw bytes plus an index of types by id.
pub struct Btf {
    data: Vec<u8>,
    strings: (usize, usize),
    /// For a module's split BTF merged onto vmlinux: the string offset where the module's own
    /// strings begin (the base's string length) and where they lie in `data`.
    split_strings: Option<(u32, usize, usize)>,
    /// `types[id - 1]`; a module's types follow the base's, as their ids do.
    types: Vec<Type>,
    /// `(hash of the name, id)` of every named type, sorted: a lookup by name is a binary
    /// search instead of a scan of every type (a scan costs about 1.4 ms on a 6.18 vmlinux,
    /// and a start makes about 100 lookups: see docs/performance.md).
    by_name: Vec<(u32, u32)>,
}

fn name_hash(name: &str) -> u32 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0).hash_one(name) as u32
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

impl Btf {
    /// The running kernel's BTF.
    pub fn vmlinux() -> Result<Self, BtfError> {
        Self::from_file(Path::new(VMLINUX))
    }

    pub fn from_file(path: &Path) -> Result<Self, BtfError> {
        let data = std::fs::read(path).map_err(|e| BtfError::Read {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        Self::parse(data)
    }

    pub fn parse(data: Vec<u8>) -> Result<Self, BtfError> {
        let bad = |s: &str| BtfError::Malformed(s.to_string());
        if data.len() < HEADER_MIN {
            return Err(bad("shorter than a BTF header"));
        }
        if u16::from_le_bytes([data[0], data[1]]) != MAGIC {
            return Err(bad("bad magic (big-endian or not BTF)"));
        }
        let hdr_len = u32_at(&data, 4).ok_or_else(|| bad("header"))? as usize;
        let type_off = u32_at(&data, 8).ok_or_else(|| bad("header"))? as usize;
        let type_len = u32_at(&data, 12).ok_or_else(|| bad("header"))? as usize;
        let str_off = u32_at(&data, 16).ok_or_else(|| bad("header"))? as usize;
        let str_len = u32_at(&data, 20).ok_or_else(|| bad("header"))? as usize;
        let t_start = hdr_len.saturating_add(type_off);
        let t_end = t_start.saturating_add(type_len);
        let s_start = hdr_len.saturating_add(str_off);
        let s_end = s_start.saturating_add(str_len);
        if t_end > data.len() || s_end > data.len() {
            return Err(bad("sections run past the end of the data"));
        }
        let mut types = Vec::new();
        let mut at = t_start;
        while at < t_end {
            let (Some(name_off), Some(info), Some(size_or_type)) = (
                u32_at(&data, at),
                u32_at(&data, at + 4),
                u32_at(&data, at + 8),
            ) else {
                return Err(bad("type record cut short"));
            };
            let kind = (info >> 24) & 0x1f;
            let vlen = info & 0xffff;
            let extra = at + 12;
            let extra_len = match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12 * vlen as usize,
                KIND_ENUM | KIND_FUNC_PROTO => 8 * vlen as usize,
                KIND_PTR | KIND_FWD | KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT
                | KIND_FUNC | KIND_FLOAT | KIND_TYPE_TAG => 0,
                k => return Err(BtfError::Malformed(format!("unknown type kind {k}"))),
            };
            types.push(Type {
                extra,
                name_off,
                kind,
                vlen,
                kind_flag: info >> 31 != 0,
                size_or_type,
            });
            at = extra + extra_len;
        }
        if at != t_end {
            return Err(bad("last type runs past the type section"));
        }
        let mut btf = Btf {
            data,
            strings: (s_start, s_end),
            split_strings: None,
            types,
            by_name: Vec::new(),
        };
        btf.index();
        Ok(btf)
    }

    /// Fills [`by_name`](Self::by_name): equal hashes in id order, so the first match of a
    /// name is its lowest id, as a scan would find.
    fn index(&mut self) {
        let mut by_name: Vec<(u32, u32)> = (1..=self.types.len() as u32)
            .zip(&self.types)
            .filter(|(_, t)| t.name_off != 0)
            .map(|(id, t)| (name_hash(self.name(t.name_off)), id))
            .collect();
        by_name.sort_unstable();
        self.by_name = by_name;
    }

    /// The types named `name`, lowest id first.
    fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = (u32, &'a Type)> + 'a {
        let h = name_hash(name);
        let from = self.by_name.partition_point(|&(x, _)| x < h);
        self.by_name[from..]
            .iter()
            .take_while(move |&&(x, _)| x == h)
            .filter_map(move |&(_, id)| {
                let t = self.get(id)?;
                (self.name(t.name_off) == name).then_some((id, t))
            })
    }

    /// A kernel module's BTF (`/sys/kernel/btf/<module>`), which is split BTF: its type ids
    /// continue after vmlinux's and its string offsets after vmlinux's strings. The result
    /// holds both, so a module struct's members of vmlinux types resolve.
    pub fn module(base: &Btf, module: &str) -> Result<Self, BtfError> {
        let path = Path::new("/sys/kernel/btf").join(module);
        let data = std::fs::read(&path).map_err(|e| BtfError::Read {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        Self::parse_split(base, data)
    }

    pub fn parse_split(base: &Btf, data: Vec<u8>) -> Result<Self, BtfError> {
        if base.split_strings.is_some() {
            return Err(BtfError::Malformed("split BTF cannot be a base".into()));
        }
        let module = Self::parse(data)?;
        let shift = base.data.len();
        let base_str_len = (base.strings.1 - base.strings.0) as u32;
        let mut data = Vec::with_capacity(shift + module.data.len());
        data.extend_from_slice(&base.data);
        data.extend_from_slice(&module.data);
        let mut types = Vec::with_capacity(base.types.len() + module.types.len());
        types.extend_from_slice(&base.types);
        types.extend(module.types.iter().map(|t| Type {
            extra: t.extra + shift,
            ..*t
        }));
        let mut btf = Btf {
            data,
            strings: base.strings,
            split_strings: Some((
                base_str_len,
                module.strings.0 + shift,
                module.strings.1 + shift,
            )),
            types,
            by_name: Vec::new(),
        };
        btf.index();
        Ok(btf)
    }

    fn name(&self, off: u32) -> &str {
        let (start, end, off) = match self.split_strings {
            Some((base_len, start, end)) if off >= base_len => (start, end, off - base_len),
            _ => (self.strings.0, self.strings.1, off),
        };
        let Some(from) = start.checked_add(off as usize).filter(|&f| f < end) else {
            return "";
        };
        let s = &self.data[from..end];
        let n = s.iter().position(|&c| c == 0).unwrap_or(s.len());
        std::str::from_utf8(&s[..n]).unwrap_or("")
    }

    fn get(&self, id: u32) -> Option<&Type> {
        self.types.get((id as usize).checked_sub(1)?)
    }

    /// Follows typedefs and qualifiers to the underlying type id.
    fn resolve(&self, mut id: u32) -> u32 {
        for _ in 0..32 {
            match self.get(id) {
                Some(t)
                    if matches!(
                        t.kind,
                        KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG
                    ) =>
                {
                    id = t.size_or_type
                }
                _ => break,
            }
        }
        id
    }

    /// The id of the struct named `name` that has members (not a forward declaration).
    fn struct_id(&self, name: &str) -> Option<u32> {
        self.named(name)
            .find(|(_, t)| t.kind == KIND_STRUCT && t.vlen > 0)
            .map(|(id, _)| id)
    }

    /// Members of a struct/union: (name, type id, bit offset, bitfield size).
    fn members(&self, t: &Type) -> impl Iterator<Item = (&str, u32, u32, u32)> + '_ {
        let t = *t;
        (0..t.vlen as usize).filter_map(move |i| {
            let at = t.extra + 12 * i;
            let name = self.name(u32_at(&self.data, at)?);
            let ty = u32_at(&self.data, at + 4)?;
            let off = u32_at(&self.data, at + 8)?;
            let (bits, size) = if t.kind_flag {
                (off & 0x00ff_ffff, off >> 24)
            } else {
                (off, 0)
            };
            Some((name, ty, bits, size))
        })
    }

    /// Finds `member` in struct/union `id`, looking into anonymous members. Returns the bit
    /// offset from the start of `id` and the member's type.
    fn find_member(&self, id: u32, member: &str, depth: u32) -> Option<(u32, u32, u32)> {
        if depth > 8 {
            return None;
        }
        let t = self.get(self.resolve(id))?;
        if t.kind != KIND_STRUCT && t.kind != KIND_UNION {
            return None;
        }
        for (name, ty, bits, bf) in self.members(t) {
            if name == member {
                return Some((bits, ty, bf));
            }
            if name.is_empty() {
                if let Some((inner, ity, ibf)) = self.find_member(ty, member, depth + 1) {
                    return Some((bits + inner, ity, ibf));
                }
            }
        }
        None
    }

    /// Whether the kernel has a function named `name` in this BTF (what fentry attaches to).
    pub fn has_func(&self, name: &str) -> bool {
        self.named(name).any(|(_, t)| t.kind == KIND_FUNC)
    }

    /// Byte offset of `path` (members separated by `.`, e.g. `nd_net.net`) inside
    /// `struct strukt`. Anonymous structs and unions on the way are looked through.
    pub fn member_offset(&self, strukt: &str, path: &str) -> Result<u32, BtfError> {
        self.member(strukt, path).map(|(off, _)| off)
    }

    /// [`member_offset`](Self::member_offset) and the member's size in bytes (0 when BTF
    /// does not give one: arrays, functions).
    pub fn member(&self, strukt: &str, path: &str) -> Result<(u32, u32), BtfError> {
        let mut id = self
            .struct_id(strukt)
            .ok_or_else(|| BtfError::NoStruct(strukt.to_string()))?;
        let mut bits = 0u32;
        for seg in path.split('.') {
            let (b, ty, bf) = self
                .find_member(id, seg, 0)
                .ok_or_else(|| BtfError::NoMember {
                    strukt: strukt.to_string(),
                    member: path.to_string(),
                })?;
            if bf != 0 {
                return Err(BtfError::Bitfield(format!("{strukt}.{path}")));
            }
            bits += b;
            id = ty;
        }
        if !bits.is_multiple_of(8) {
            return Err(BtfError::Bitfield(format!("{strukt}.{path}")));
        }
        Ok((bits / 8, self.size_of(id)))
    }

    /// Size in bytes of type `id` (pointers: 8, the kernels xtlock runs on are 64-bit).
    fn size_of(&self, id: u32) -> u32 {
        match self.get(self.resolve(id)) {
            Some(t) if t.kind == KIND_PTR => 8,
            Some(t)
                if matches!(
                    t.kind,
                    KIND_INT | KIND_STRUCT | KIND_UNION | KIND_ENUM | KIND_ENUM64 | KIND_FLOAT
                ) =>
            {
                t.size_or_type
            }
            _ => 0,
        }
    }

    /// The parameter types of the function pointer typedef `name`, in C words (`struct
    /// inode *`, `int`): how a raw tracepoint's arguments are laid out is its
    /// `btf_trace_<name>` typedef (a `void *` context first, then the `TP_PROTO` arguments).
    pub fn fn_typedef_params(&self, name: &str) -> Option<Vec<String>> {
        let (_, td) = self.named(name).find(|(_, t)| t.kind == KIND_TYPEDEF)?;
        let ptr = self.get(td.size_or_type).filter(|t| t.kind == KIND_PTR)?;
        let proto = self
            .get(self.resolve(ptr.size_or_type))
            .filter(|t| t.kind == KIND_FUNC_PROTO)?;
        let mut out = Vec::with_capacity(proto.vlen as usize);
        for i in 0..proto.vlen as usize {
            let ty = u32_at(&self.data, proto.extra + 8 * i + 4)?;
            out.push(self.c_name(ty));
        }
        Some(out)
    }

    /// A type as C spells it, through typedefs and qualifiers: `struct inode *`, `int`.
    fn c_name(&self, id: u32) -> String {
        match self.get(self.resolve(id)) {
            None => "void".into(),
            Some(t) if t.kind == KIND_PTR => format!("{} *", self.c_name(t.size_or_type)),
            Some(t) => {
                let n = self.name(t.name_off);
                match t.kind {
                    KIND_STRUCT => format!("struct {n}"),
                    KIND_UNION => format!("union {n}"),
                    // A forward declaration: kind_flag tells a union from a struct.
                    KIND_FWD if t.kind_flag => format!("union {n}"),
                    KIND_FWD => format!("struct {n}"),
                    KIND_ENUM | KIND_ENUM64 => format!("enum {n}"),
                    _ => n.to_string(),
                }
            }
        }
    }

    /// A type as a prototype check compares it: what a pointer points to (struct or union
    /// name, or its C name), else the size of a scalar.
    fn arg_type(&self, id: u32) -> ArgType {
        match self.get(self.resolve(id)) {
            None => ArgType::Void,
            Some(t) if t.kind == KIND_PTR => match self.get(self.resolve(t.size_or_type)) {
                Some(p) if matches!(p.kind, KIND_STRUCT | KIND_UNION) => {
                    ArgType::Ptr(self.name(p.name_off).to_string())
                }
                Some(p) if p.kind == KIND_FWD => ArgType::FwdPtr(self.name(p.name_off).to_string()),
                _ => ArgType::Ptr(String::new()),
            },
            Some(t) if matches!(t.kind, KIND_INT | KIND_ENUM | KIND_ENUM64) => {
                ArgType::Int(t.size_or_type)
            }
            Some(_) => ArgType::Other(self.typedef_name(id).unwrap_or_else(|| self.c_name(id))),
        }
    }

    /// The name of the first typedef behind `id`'s qualifiers (`sockptr_t` is a typedef of
    /// an unnamed struct, whose C name says nothing).
    fn typedef_name(&self, mut id: u32) -> Option<String> {
        for _ in 0..32 {
            let t = self.get(id)?;
            match t.kind {
                KIND_TYPEDEF => return Some(self.name(t.name_off).to_string()),
                KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => id = t.size_or_type,
                _ => return None,
            }
        }
        None
    }

    /// The prototype of function `name` (a `FUNC` and its `FUNC_PROTO`), if this BTF has it.
    pub fn func_proto(&self, name: &str) -> Option<FuncProto> {
        let (_, func) = self.named(name).find(|(_, t)| t.kind == KIND_FUNC)?;
        let proto = self
            .get(func.size_or_type)
            .filter(|t| t.kind == KIND_FUNC_PROTO)?;
        let mut params = Vec::with_capacity(proto.vlen as usize);
        for i in 0..proto.vlen as usize {
            let ty = u32_at(&self.data, proto.extra + 8 * i + 4)?;
            params.push((self.arg_type(ty), self.c_name(ty)));
        }
        Some(FuncProto {
            params,
            ret: (
                self.arg_type(proto.size_or_type),
                self.c_name(proto.size_or_type),
            ),
        })
    }

    /// Values of `enum name` (32- or 64-bit enums), in declaration order.
    pub fn enum_values(&self, name: &str) -> Option<Vec<(String, i64)>> {
        let (_, t) = self
            .named(name)
            .find(|(_, t)| t.kind == KIND_ENUM || t.kind == KIND_ENUM64)?;
        let mut out = Vec::with_capacity(t.vlen as usize);
        for i in 0..t.vlen as usize {
            if t.kind == KIND_ENUM {
                let at = t.extra + 8 * i;
                let n = self.name(u32_at(&self.data, at)?);
                let v = u32_at(&self.data, at + 4)? as i32;
                out.push((n.to_string(), i64::from(v)));
            } else {
                let at = t.extra + 12 * i;
                let n = self.name(u32_at(&self.data, at)?);
                let lo = u64::from(u32_at(&self.data, at + 4)?);
                let hi = u64::from(u32_at(&self.data, at + 8)?);
                out.push((n.to_string(), ((hi << 32) | lo) as i64));
            }
        }
        Some(out)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds BTF bytes from type records (each the 12-byte header plus extra data).
    pub(crate) struct Builder {
        types: Vec<u8>,
        strings: Vec<u8>,
        /// Split BTF: the base's string length, added to every string offset.
        str_base: u32,
    }

    impl Builder {
        pub fn new() -> Self {
            Builder {
                types: Vec::new(),
                strings: vec![0],
                str_base: 0,
            }
        }
        pub fn split(base_strings: u32) -> Self {
            Builder {
                str_base: base_strings,
                ..Self::new()
            }
        }
        pub fn s(&mut self, name: &str) -> u32 {
            if name.is_empty() {
                return 0;
            }
            let off = self.str_base + self.strings.len() as u32;
            self.strings.extend_from_slice(name.as_bytes());
            self.strings.push(0);
            off
        }
        fn push(&mut self, words: &[u32]) {
            for w in words {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
        }
        pub fn int(&mut self, name: &str, size: u32) {
            let n = self.s(name);
            self.push(&[n, KIND_INT << 24, size, size * 8]);
        }
        pub fn ptr(&mut self, to: u32) {
            self.push(&[0, KIND_PTR << 24, to]);
        }
        pub fn typedef(&mut self, name: &str, to: u32) {
            let n = self.s(name);
            self.push(&[n, KIND_TYPEDEF << 24, to]);
        }
        /// Members: (name, type, bit offset).
        pub fn strukt(&mut self, kind: u32, name: &str, size: u32, members: &[(&str, u32, u32)]) {
            let n = self.s(name);
            self.push(&[n, (kind << 24) | members.len() as u32, size]);
            for (m, ty, off) in members {
                let mn = self.s(m);
                self.push(&[mn, *ty, *off]);
            }
        }
        /// A function prototype of these parameter types (returning void).
        pub fn func_proto(&mut self, params: &[u32]) {
            self.func_proto_ret(params, 0);
        }
        /// A function prototype of these parameter types returning `ret`.
        pub fn func_proto_ret(&mut self, params: &[u32], ret: u32) {
            self.push(&[0, (KIND_FUNC_PROTO << 24) | params.len() as u32, ret]);
            for p in params {
                self.push(&[0, *p]);
            }
        }
        /// A function named `name` of prototype `proto`.
        pub fn func(&mut self, name: &str, proto: u32) {
            let n = self.s(name);
            self.push(&[n, KIND_FUNC << 24, proto]);
        }
        pub fn konst(&mut self, to: u32) {
            self.push(&[0, KIND_CONST << 24, to]);
        }
        pub fn fwd(&mut self, name: &str) {
            let n = self.s(name);
            self.push(&[n, KIND_FWD << 24, 0]);
        }
        pub fn enumeration(&mut self, name: &str, values: &[(&str, i32)]) {
            let n = self.s(name);
            self.push(&[n, (KIND_ENUM << 24) | values.len() as u32, 4]);
            for (v, x) in values {
                let vn = self.s(v);
                self.push(&[vn, *x as u32]);
            }
        }
        pub fn build(&self) -> Vec<u8> {
            let mut b = Vec::new();
            b.extend_from_slice(&MAGIC.to_le_bytes());
            b.push(1);
            b.push(0);
            for w in [
                24u32,
                0,
                self.types.len() as u32,
                self.types.len() as u32,
                self.strings.len() as u32,
            ] {
                b.extend_from_slice(&w.to_le_bytes());
            }
            b.extend_from_slice(&self.types);
            b.extend_from_slice(&self.strings);
            b
        }
    }

    /// `struct sk_buff { union { struct { void *next, *prev; struct net_device *dev; }; }; ...
    /// unsigned char *head; }` and friends, with an anonymous union and a typedef'd struct.
    pub(crate) fn sample() -> Vec<u8> {
        let mut b = Builder::new();
        b.int("int", 4); // 1
        b.ptr(0); // 2: void *
        b.strukt(
            KIND_STRUCT,
            "",
            24,
            &[("next", 2, 0), ("prev", 2, 64), ("dev", 2, 128)],
        ); // 3
        b.strukt(KIND_UNION, "", 24, &[("", 3, 0), ("rbnode", 2, 0)]); // 4
        b.int("__u16", 2); // 5
        b.strukt(
            KIND_STRUCT,
            "sk_buff",
            200,
            &[("", 4, 0), ("head", 2, 1280), ("network_header", 5, 1424)],
        ); // 6
        b.strukt(KIND_STRUCT, "", 8, &[("net", 2, 0)]); // 7
        b.typedef("possible_net_t", 7); // 8
        b.strukt(
            KIND_STRUCT,
            "net_device",
            300,
            &[("ifindex", 1, 1792), ("nd_net", 8, 2048)],
        ); // 9
        b.enumeration(
            "skb_drop_reason",
            &[("SKB_NOT_DROPPED_YET", 0), ("SKB_DROP_REASON_NO_SOCKET", 3)],
        );
        // A bitfield member (kind_flag set).
        let n = b.s("bits");
        let m = b.s("flag");
        b.push(&[n, (KIND_STRUCT << 24) | (1 << 31) | 1, 4]);
        b.push(&[m, 1, (1 << 24) | 3]);
        b.build()
    }

    #[test]
    fn members_through_anonymous_unions_and_typedefs() {
        let btf = Btf::parse(sample()).unwrap();
        assert_eq!(btf.member_offset("sk_buff", "dev"), Ok(16));
        assert_eq!(btf.member_offset("sk_buff", "head"), Ok(160));
        assert_eq!(btf.member_offset("sk_buff", "network_header"), Ok(178));
        assert_eq!(btf.member_offset("net_device", "ifindex"), Ok(224));
        assert_eq!(btf.member_offset("net_device", "nd_net.net"), Ok(256));
        // Sizes through typedefs, of pointers and of nested members.
        assert_eq!(btf.member("sk_buff", "network_header"), Ok((178, 2)));
        assert_eq!(btf.member("sk_buff", "dev"), Ok((16, 8)));
        assert_eq!(btf.member("net_device", "ifindex"), Ok((224, 4)));
        assert_eq!(btf.member("net_device", "nd_net"), Ok((256, 8)));
        assert!(matches!(
            btf.member_offset("sk_buff", "nope"),
            Err(BtfError::NoMember { .. })
        ));
        assert!(matches!(
            btf.member_offset("nosuch", "x"),
            Err(BtfError::NoStruct(_))
        ));
        assert!(matches!(
            btf.member_offset("bits", "flag"),
            Err(BtfError::Bitfield(_))
        ));
        assert_eq!(
            btf.enum_values("skb_drop_reason").unwrap(),
            vec![
                ("SKB_NOT_DROPPED_YET".to_string(), 0),
                ("SKB_DROP_REASON_NO_SOCKET".to_string(), 3)
            ]
        );
    }

    /// Lookups by name find the first type of the asked kind, whatever else shares the name.
    #[test]
    fn names_shared_by_several_types() {
        let mut b = Builder::new();
        b.int("int", 4); // 1
        b.strukt(KIND_STRUCT, "dup", 0, &[]); // 2: declared only
        b.typedef("dup", 1); // 3
        b.strukt(KIND_STRUCT, "dup", 8, &[("a", 1, 0), ("b", 1, 32)]); // 4
        b.strukt(KIND_STRUCT, "dup", 8, &[("b", 1, 0)]); // 5: a later duplicate
        b.func_proto(&[1]); // 6
        b.func("dup", 6); // 7
        b.enumeration("dup", &[("DUP_ONE", 1)]); // 8
        let btf = Btf::parse(b.build()).unwrap();
        assert_eq!(btf.member("dup", "b"), Ok((4, 4)));
        assert!(btf.has_func("dup"));
        assert!(!btf.has_func("int"));
        assert_eq!(btf.func_proto("dup").unwrap().params.len(), 1);
        assert_eq!(
            btf.enum_values("dup").unwrap(),
            [("DUP_ONE".to_string(), 1)]
        );
        assert_eq!(btf.fn_typedef_params("dup"), None);
        assert!(matches!(btf.member("int", "a"), Err(BtfError::NoStruct(_))));
    }

    #[test]
    fn raw_tracepoint_prototype() {
        let mut b = Builder::new();
        b.int("int", 4); // 1
        b.strukt(KIND_STRUCT, "inode", 8, &[("i_ino", 1, 0)]); // 2
        b.ptr(2); // 3
        b.ptr(0); // 4: void *
        b.func_proto(&[4, 3, 1]); // 5
        b.ptr(5); // 6
        b.typedef("btf_trace_flock_lock_inode", 6); // 7
        b.typedef("not_a_fn", 1); // 8
        let btf = Btf::parse(b.build()).unwrap();
        assert_eq!(
            btf.fn_typedef_params("btf_trace_flock_lock_inode").unwrap(),
            ["void *", "struct inode *", "int"]
        );
        assert_eq!(btf.fn_typedef_params("not_a_fn"), None);
        assert_eq!(btf.fn_typedef_params("nope"), None);
    }

    /// `struct nf_conn *__nf_conntrack_alloc(struct net *, const struct nf_conntrack_zone *,
    /// const struct nf_conntrack_tuple *, ..., gfp_t, u32)`, and a function whose pointer
    /// parameter is a forward declaration (5.10's `__x64_sys_execveat`).
    #[test]
    fn function_prototypes() {
        let mut b = Builder::new();
        b.int("unsigned int", 4); // 1
        b.strukt(KIND_STRUCT, "net", 8, &[]); // 2
        b.ptr(2); // 3: struct net *
        b.strukt(KIND_STRUCT, "nf_conntrack_tuple", 40, &[]); // 4
        b.konst(4); // 5
        b.ptr(5); // 6: const struct nf_conntrack_tuple *
        b.strukt(KIND_STRUCT, "nf_conn", 8, &[]); // 7
        b.ptr(7); // 8
        b.typedef("gfp_t", 1); // 9
        b.func_proto_ret(&[3, 6, 6, 9], 8); // 10
        b.func("__nf_conntrack_alloc", 10); // 11
        b.fwd("pt_regs"); // 12
        b.konst(12); // 13
        b.ptr(13); // 14
        b.int("long int", 8); // 15
        b.func_proto_ret(&[14], 15); // 16
        b.func("__x64_sys_execveat", 16); // 17

        // `int nf_setsockopt(..., sockptr_t opt, ...)`: a typedef'd unnamed struct by value.
        b.strukt(KIND_STRUCT, "", 16, &[]); // 18
        b.typedef("sockptr_t", 18); // 19
        b.func_proto_ret(&[3, 19, 1], 1); // 20
        b.func("nf_setsockopt", 20); // 21
        let btf = Btf::parse(b.build()).unwrap();
        let p = btf.func_proto("nf_setsockopt").unwrap();
        assert_eq!(p.params[1].0, ArgType::Other("sockptr_t".into()));
        let p = btf.func_proto("__nf_conntrack_alloc").unwrap();
        assert_eq!(p.params.len(), 4);
        assert_eq!(p.params[0].0, ArgType::Ptr("net".into()));
        assert_eq!(
            p.params[2],
            (
                ArgType::Ptr("nf_conntrack_tuple".into()),
                "struct nf_conntrack_tuple *".into()
            )
        );
        assert_eq!(p.params[3], (ArgType::Int(4), "unsigned int".into()));
        assert_eq!(p.ret.0, ArgType::Ptr("nf_conn".into()));
        let p = btf.func_proto("__x64_sys_execveat").unwrap();
        assert_eq!(
            p.params,
            [(ArgType::FwdPtr("pt_regs".into()), "struct pt_regs *".into())]
        );
        assert_eq!(p.ret.0, ArgType::Int(8));
        assert_eq!(btf.func_proto("nope"), None);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(Btf::parse(Vec::new()).is_err());
        let good = sample();
        for n in 0..good.len() {
            let _ = Btf::parse(good[..n].to_vec());
        }
        let mut bad = good.clone();
        bad[0] = 0;
        assert!(Btf::parse(bad).is_err());
        for i in 24..good.len() {
            let mut b = good.clone();
            b[i] ^= 0xff;
            if let Ok(btf) = Btf::parse(b) {
                let _ = btf.member_offset("sk_buff", "nd_net.net");
                let _ = btf.enum_values("skb_drop_reason");
            }
        }
    }

    /// The running kernel's BTF, when it has one.
    #[test]
    fn module_split_btf_resolves_through_vmlinux() {
        let base = Btf::parse(sample()).unwrap();
        let first = base.types.len() as u32 + 1;
        let mut m = Builder::split((base.strings.1 - base.strings.0) as u32);
        // struct ip_vs_dest { __u16 port; struct sk_buff *skb; } with __u16 (5) from the base.
        m.ptr(6); // first: struct sk_buff *
        m.strukt(
            KIND_STRUCT,
            "ip_vs_dest",
            16,
            &[("port", 5, 32), ("skb", first, 64)],
        );
        let btf = Btf::parse_split(&base, m.build()).unwrap();
        assert_eq!(btf.member_offset("ip_vs_dest", "port"), Ok(4));
        assert_eq!(btf.member_offset("ip_vs_dest", "skb"), Ok(8));
        // Base types and names still resolve, through the merged data.
        assert_eq!(btf.member_offset("sk_buff", "dev"), Ok(16));
        assert_eq!(btf.member_offset("net_device", "nd_net.net"), Ok(256));
        assert!(Btf::parse_split(&btf, m.build()).is_err());
        // A module BTF cut short is an error, not a panic.
        let bytes = m.build();
        for cut in 0..bytes.len() {
            let _ = Btf::parse_split(&base, bytes[..cut].to_vec());
        }
    }

    #[test]
    fn this_kernel() {
        let Ok(btf) = Btf::vmlinux() else {
            eprintln!("skipped: no readable {VMLINUX}");
            return;
        };
        for (s, m) in [
            ("sk_buff", "head"),
            ("sk_buff", "dev"),
            ("sk_buff", "network_header"),
            ("net_device", "nd_net.net"),
            ("net", "ns.inum"),
            ("sock", "__sk_common.skc_net.net"),
        ] {
            btf.member_offset(s, m)
                .unwrap_or_else(|e| panic!("{s}.{m}: {e}"));
        }
        assert!(btf
            .enum_values("skb_drop_reason")
            .is_some_and(|v| v.len() > 10));
    }
}
