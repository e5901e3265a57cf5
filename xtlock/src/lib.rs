//! xtlock: who holds the netfilter lock, for how long, and who waits behind it.
//!
//! One pipeline serves every mode, and facts flow one way through it: `probes` load and
//! attach the BPF programs; a `source` yields their records (or a `capture` file's), decoded
//! into events (`decode`); the `analysis` turns events into facts (`analysis::facts`); `sinks`
//! show or export them; `commands` wire the four together. See docs/architecture.md.
pub mod analysis;
pub mod capture;
pub mod cli;
pub mod commands;
pub mod decode;
#[cfg(test)]
mod drift;
pub mod event;
pub mod kube;
pub mod lockfiles;
pub mod pipeline;
pub mod probes;
pub mod serve;
pub mod shared;
pub mod sinks;
pub mod source;
