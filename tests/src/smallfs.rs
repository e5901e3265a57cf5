//! A small tmpfs to run out of space on: what a full disk looks like to a recorder.

use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::Command,
};

/// A tmpfs of a few hundred KiB mounted on a scratch directory; unmounted on drop.
pub struct SmallFs {
    pub dir: PathBuf,
}

impl SmallFs {
    /// Mounts a tmpfs of `kib` KiB on `dir` (created). Needs root.
    pub fn mount(dir: &Path, kib: u64) -> Self {
        fs::create_dir_all(dir).expect("mount point");
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={kib}k,mode=0755"))
            .arg("tmpfs")
            .arg(dir)
            .status()
            .expect("run mount");
        assert!(st.success(), "mount -t tmpfs on {}", dir.display());
        Self {
            dir: dir.to_owned(),
        }
    }

    /// Fills the file system to the last byte with `filler`; returns its path.
    pub fn fill(&self) -> PathBuf {
        let p = self.dir.join("filler");
        let mut f = fs::File::create(&p).expect("filler");
        let block = vec![0xa5u8; 4096];
        // Whole blocks, then single bytes, until the kernel says no space.
        while f.write_all(&block).is_ok() {}
        while f.write_all(&block[..1]).is_ok() {}
        let _ = f.sync_all();
        p
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}
