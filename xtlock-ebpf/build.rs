// Rebuild the BPF object when bpf-linker changes (it is not a cargo dependency).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
