//! One module per kernel hook.
pub mod flock;
pub mod process;
pub mod setsockopt;
