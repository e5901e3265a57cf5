//! xtlock: who holds the netfilter lock, for how long, and who waits behind it.
//!
//! One pipeline serves every mode: a source (`source`) yields decoded events (`decode`), the
//! analysis (`procs`, `attribution`, `lock`, `stats`, behind `analysis`) turns them into facts,
//! and sinks (`sinks`) show them. `probes` loads and attaches the BPF programs.
pub mod analysis;
pub mod attribution;
pub mod capture;
pub mod cli;
pub mod commands;
pub mod decode;
pub mod drops;
pub mod ipvs;
pub mod kube;
pub mod lock;
pub mod lockfiles;
pub mod pipeline;
pub mod probes;
pub mod procs;
pub mod serve;
pub mod shared;
pub mod sinks;
pub mod source;
pub mod stats;
