//! The terminal's only way out: whole lines, each escaped as one piece.
//!
//! Names and arguments come from traced processes, which any local user can start with an
//! `argv[0]` or argument full of escape sequences and newlines. Escaping here, where every line
//! leaves, rather than where a fact is worded, means a new fact cannot forget it: nothing a
//! line holds can move the cursor, change the terminal or start a line of its own.

use std::fmt::{self, Write as _};
use std::io::{self, Write};

/// A writer that only takes whole lines, and shows every control character in them visibly.
pub(crate) struct SafeLines<W: Write> {
    w: W,
    buf: String,
}

impl<W: Write> SafeLines<W> {
    pub(crate) fn new(w: W) -> Self {
        SafeLines {
            w,
            buf: String::new(),
        }
    }

    /// Writes `args` as one line: a newline inside it is shown as `\n`, not obeyed.
    pub(crate) fn line(&mut self, args: fmt::Arguments<'_>) -> io::Result<()> {
        self.buf.clear();
        // Writing into a String cannot fail: a failing Display impl would be a bug of ours.
        let mut raw = String::new();
        raw.write_fmt(args)
            .map_err(|_| io::Error::other("formatting a line failed"))?;
        escape_into(&mut self.buf, &raw);
        self.buf.push('\n');
        self.w.write_all(self.buf.as_bytes())
    }

    /// An empty line.
    pub(crate) fn blank(&mut self) -> io::Result<()> {
        self.w.write_all(b"\n")
    }

    pub(crate) fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }

    pub(crate) fn into_inner(self) -> W {
        self.w
    }
}

/// `say!(w, "...", args)`: one escaped line on a [`SafeLines`].
macro_rules! say {
    ($w:expr, $($arg:tt)*) => {
        $w.line(format_args!($($arg)*))
    };
}
pub(crate) use say;

/// Appends `s` to `out` with every character that could act on a terminal shown as an escape:
/// C0 controls and DEL (`\e`, `\n`, `\r`, `\t`, `\x07`), C1 controls (`\u{9b}`, which some
/// terminals take as CSI) and the bidirectional overrides that reorder what is shown.
pub fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '\x1b' => out.push_str("\\e"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\0'..='\x1f' | '\x7f' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            '\u{80}'..='\u{9f}'
            | '\u{200e}'
            | '\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2066}'..='\u{2069}' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
}

/// `s` escaped as [`escape_into`] does, for text outside the terminal sink (e.g. logs).
pub fn escaped(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    escape_into(&mut out, s);
    out
}

/// Text logs' writer: each record arrives whole (tracing-subscriber formats a record, then
/// writes it at once), so every control character in it but the final newline is a field's
/// and is escaped. Log fields carry lock paths, pod and process names.
pub struct SafeLogWriter<W: Write>(pub W);

impl<W: Write> Write for SafeLogWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let (body, end) = match buf.strip_suffix(b"\n") {
            Some(body) => (body, "\n"),
            None => (buf, ""),
        };
        let mut out = escaped(&String::from_utf8_lossy(body));
        out.push_str(end);
        self.0.write_all(out.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_are_shown_not_obeyed() {
        let hostile =
            "kube-proxy\x1b]0;owned\x07 x\n06:00:00.000 kube-proxy held\r\t\x7f\u{9b}2J\u{202e}";
        let e = escaped(hostile);
        assert_eq!(
            e,
            "kube-proxy\\e]0;owned\\x07 x\\n06:00:00.000 kube-proxy held\\r\\t\\x7f\\u{9b}2J\\u{202e}"
        );
        assert!(!e.chars().any(|c| c.is_control()));
        // Ordinary text, UTF-8 included, is left alone.
        assert_eq!(escaped("calico-node µs ü"), "calico-node µs ü");
    }

    #[test]
    fn a_line_is_one_line_whatever_it_holds() {
        let mut w = SafeLines::new(Vec::new());
        say!(w, "{} held", "a\nb").unwrap();
        w.blank().unwrap();
        let out = String::from_utf8(w.into_inner()).unwrap();
        assert_eq!(out, "a\\nb held\n\n");
    }

    #[test]
    fn a_log_record_keeps_only_its_own_newline() {
        let mut w = SafeLogWriter(Vec::new());
        w.write_all(b"INFO watching /run/x\x1b[2J\nFAKE (inode 1)\n")
            .unwrap();
        assert_eq!(w.0, b"INFO watching /run/x\\e[2J\\nFAKE (inode 1)\n");
    }
}
