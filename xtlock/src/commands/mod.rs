//! One file per subcommand, each wiring a source to sinks.
pub mod probes;
pub mod trace;
