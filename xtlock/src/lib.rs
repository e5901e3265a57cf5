//! xtlock: who holds the netfilter lock, for how long, and who waits behind it.
pub mod decode;
