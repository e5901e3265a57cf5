//! tracefs: where it is, mounting it when missing, and reading tracepoint `format` files so
//! field offsets come from the running kernel rather than from one kernel's headers.

use std::{
    fs,
    path::{Path, PathBuf},
};

use super::ProbeError;

const CANDIDATES: &[&str] = &["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// Finds tracefs, mounting it at /sys/kernel/tracing when no mount has the events.
pub fn locate() -> Result<PathBuf, ProbeError> {
    for c in CANDIDATES {
        let p = Path::new(c);
        match fs::metadata(p.join("events")) {
            Ok(m) if m.is_dir() => return Ok(p.to_path_buf()),
            // Mounted (tracefs is 0700 on recent kernels) but closed to this process:
            // mounting it again would not help, a capability would.
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                return Err(ProbeError::Permission(format!(
                    "tracefs is mounted at {c} but this process may not read it \
                         ({e}); its mode is 0700 on recent kernels, so reading it needs \
                         CAP_DAC_OVERRIDE (or CAP_DAC_READ_SEARCH) besides CAP_BPF and \
                         CAP_PERFMON: add it, or run as root"
                )))
            }
            _ => {}
        }
    }
    let target = Path::new(CANDIDATES[0]);
    mount_tracefs(target)?;
    match fs::metadata(target.join("events")) {
        Ok(m) if m.is_dir() => {
            tracing::info!(path = %target.display(), "mounted tracefs");
            return Ok(target.to_path_buf());
        }
        // Mounted now, but 0700 and root's: not root, and no capability to read it anyway.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(ProbeError::Permission(format!(
                "tracefs (mounted at {}) is closed to this process ({e}): it is root's with \
                 mode 0700 on recent kernels; run as root (uid 0), or add CAP_DAC_OVERRIDE \
                 (or CAP_DAC_READ_SEARCH)",
                target.display()
            )));
        }
        _ => {}
    }
    Err(ProbeError::NoTracefs {
        why: format!("{} is mounted but has no events/", target.display()),
    })
}

fn mount_tracefs(target: &Path) -> Result<(), ProbeError> {
    use std::ffi::CString;
    let err = |why: String| ProbeError::NoTracefs { why };
    if !target.is_dir() {
        return Err(err(format!("{} does not exist", target.display())));
    }
    let src = CString::new("tracefs").map_err(|e| err(e.to_string()))?;
    let dst =
        CString::new(target.as_os_str().as_encoded_bytes()).map_err(|e| err(e.to_string()))?;
    // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            src.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(err(format!(
            "mount -t tracefs tracefs {}: {e}",
            target.display()
        )));
    }
    Ok(())
}

/// One `field:` line of a format file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    /// The C declaration without the name, e.g. `unsigned long`, `__data_loc char[]`.
    pub ctype: String,
    pub offset: u32,
    pub size: u32,
}

/// The parsed `format` file of one tracepoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Format {
    pub fields: Vec<Field>,
    /// The `print fmt:` line, without its prefix (holds e.g. `__print_symbolic` tables).
    pub print_fmt: Option<String>,
}

impl Format {
    /// Reads `events/<category>/<name>/format`. `Ok(None)` when the tracepoint does not exist
    /// on this kernel.
    pub fn read(tracefs: &Path, category: &str, name: &str) -> Result<Option<Self>, ProbeError> {
        let path = tracefs
            .join("events")
            .join(category)
            .join(name)
            .join("format");
        match fs::read_to_string(&path) {
            Ok(text) => Ok(Some(Self::parse(&text))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ProbeError::Io {
                what: format!("reading {}", path.display()),
                error: e,
            }),
        }
    }

    /// Parses a format file; lines that do not describe a field are skipped.
    pub fn parse(text: &str) -> Self {
        let fields = text.lines().filter_map(parse_field).collect();
        let print_fmt = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("print fmt:"))
            .map(|s| s.trim().to_string());
        Self { fields, print_fmt }
    }

    /// The first field whose name is one of `names` (kernels rename fields: `fl_owner` became
    /// `owner` in 6.9).
    pub fn field(&self, names: &[&str]) -> Option<&Field> {
        names
            .iter()
            .find_map(|n| self.fields.iter().find(|f| f.name == *n))
    }
}

fn parse_field(line: &str) -> Option<Field> {
    // "\tfield:unsigned long i_ino;\toffset:16;\tsize:8;\tsigned:0;"
    let line = line.trim();
    let rest = line.strip_prefix("field:")?;
    let mut parts = rest.split(';').map(str::trim);
    let decl = parts.next()?;
    let mut offset = None;
    let mut size = None;
    for p in parts {
        if let Some(v) = p.strip_prefix("offset:") {
            offset = v.parse().ok();
        } else if let Some(v) = p.strip_prefix("size:") {
            size = v.parse().ok();
        }
    }
    // The name is the last identifier; array brackets may follow it (`char comm[16]`).
    let decl_no_array = match decl.rfind('[') {
        Some(i) if decl.ends_with(']') && !decl[..i].ends_with(' ') && !decl.contains("[]") => {
            &decl[..i]
        }
        _ => decl,
    };
    let name_start = decl_no_array
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    let name = &decl_no_array[name_start..];
    if name.is_empty() {
        return None;
    }
    Some(Field {
        name: name.to_owned(),
        ctype: decl_no_array[..name_start].trim().to_owned(),
        offset: offset?,
        size: size?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOCK_6_18: &str = "name: flock_lock_inode
ID: 500
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:struct file_lock * fl;\toffset:8;\tsize:8;\tsigned:0;
\tfield:unsigned long i_ino;\toffset:16;\tsize:8;\tsigned:0;
\tfield:dev_t s_dev;\toffset:24;\tsize:4;\tsigned:0;
\tfield:fl_owner_t owner;\toffset:40;\tsize:8;\tsigned:0;
\tfield:unsigned char type;\toffset:56;\tsize:1;\tsigned:0;
\tfield:int ret;\toffset:80;\tsize:4;\tsigned:1;

print fmt: \"fl=%p\", REC->fl
";

    // 5.10's layout: same fields, older names.
    const FLOCK_5_10: &str = "format:
\tfield:struct file_lock * fl;\toffset:8;\tsize:8;\tsigned:0;
\tfield:unsigned long i_ino;\toffset:16;\tsize:8;\tsigned:0;
\tfield:dev_t s_dev;\toffset:24;\tsize:4;\tsigned:0;
\tfield:struct file_lock * fl_blocker;\toffset:32;\tsize:8;\tsigned:0;
\tfield:fl_owner_t fl_owner;\toffset:40;\tsize:8;\tsigned:0;
\tfield:unsigned int fl_pid;\toffset:48;\tsize:4;\tsigned:0;
\tfield:unsigned int fl_flags;\toffset:52;\tsize:4;\tsigned:0;
\tfield:unsigned char fl_type;\toffset:56;\tsize:1;\tsigned:0;
\tfield:int ret;\toffset:80;\tsize:4;\tsigned:1;
";

    #[test]
    fn parses_fields_and_aliases() {
        let f = Format::parse(FLOCK_6_18);
        let ino = f.field(&["i_ino"]).unwrap();
        assert_eq!(
            (ino.offset, ino.size, ino.ctype.as_str()),
            (16, 8, "unsigned long")
        );
        assert_eq!(f.field(&["owner", "fl_owner"]).unwrap().offset, 40);
        assert_eq!(f.field(&["fl"]).unwrap().ctype, "struct file_lock *");
        let old = Format::parse(FLOCK_5_10);
        assert_eq!(old.field(&["owner", "fl_owner"]).unwrap().offset, 40);
        assert_eq!(old.field(&["type", "fl_type"]).unwrap().size, 1);
        assert!(old.field(&["nope"]).is_none());
    }

    #[test]
    fn arrays_and_data_loc() {
        let f = Format::parse(
            "\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\
             \tfield:__data_loc char[] filename;\toffset:8;\tsize:4;\tsigned:0;\n\
             \tfield:pid_t old_pid;\toffset:16;\tsize:4;\tsigned:1;\n\
             \tfield:garbage\n",
        );
        assert_eq!(f.field(&["comm"]).unwrap().size, 16);
        let fname = f.field(&["filename"]).unwrap();
        assert_eq!(fname.ctype, "__data_loc char[]");
        assert_eq!(f.field(&["old_pid"]).unwrap().offset, 16);
        assert_eq!(f.fields.len(), 3);
    }
}
