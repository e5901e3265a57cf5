//! A tiny writer for the cpio "newc" format, the one the kernel unpacks as an initramfs.
//! Directories, regular files and device nodes; no compression (the kernel reads it
//! as it is, and an initramfs of busybox and a dozen modules is a few MB).
use std::io::{self, Write};

pub struct Cpio<W: Write> {
    out: W,
    ino: u32,
    written: u64,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

impl<W: Write> Cpio<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            ino: 1,
            written: 0,
        }
    }

    pub fn dir(&mut self, path: &str, perm: u32) -> io::Result<()> {
        self.entry(path, S_IFDIR | perm, 2, (0, 0), &[])
    }

    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.entry(path, S_IFREG | perm, 1, (0, 0), data)
    }

    pub fn char_dev(&mut self, path: &str, perm: u32, major: u32, minor: u32) -> io::Result<()> {
        self.entry(path, S_IFCHR | perm, 1, (major, minor), &[])
    }

    /// Writes the trailer and returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.entry("TRAILER!!!", 0, 1, (0, 0), &[])?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn entry(
        &mut self,
        path: &str,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: &[u8],
    ) -> io::Result<()> {
        let name = path.trim_start_matches('/');
        let name = if name.is_empty() { "." } else { name };
        let size = u32::try_from(data.len())
            .map_err(|_| io::Error::other(format!("{path}: too big for cpio")))?;
        let ino = if path == "TRAILER!!!" { 0 } else { self.ino };
        self.ino += 1;
        // magic, ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor, rdevmajor,
        // rdevminor, namesize (with its NUL), check.
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            ino,
            mode,
            0,
            0,
            nlink,
            0,
            size,
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() + 1,
            0
        );
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let n = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0; 3][..n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_layout() {
        let mut c = Cpio::new(Vec::new());
        c.dir("/bin", 0o755).unwrap();
        c.file("/bin/x", 0o755, b"hello").unwrap();
        let out = c.finish().unwrap();
        let text = String::from_utf8_lossy(&out);
        assert!(out.starts_with(b"070701"));
        // The header is 110 bytes; "bin\0" pads the first entry to 116.
        assert_eq!(&out[110..114], b"bin\0");
        assert_eq!(&out[116..122], b"070701");
        assert!(text.contains("bin/x\0"));
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!"));
        assert_eq!(out.len() % 4, 0);
    }
}
