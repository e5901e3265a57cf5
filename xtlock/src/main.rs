use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::{fmt, EnvFilter};
use xtlock::{
    cli::{Cli, Command, LogFormat},
    commands,
    sinks::{self, terminal::SafeLogWriter},
};

fn init_logging(cli: &Cli) {
    let default = match cli.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // Logs always go to stderr: stdout carries the trace (and JSON) only.
    let builder = fmt().with_env_filter(filter);
    match cli.log_format {
        LogFormat::Json => builder.with_writer(std::io::stderr).json().init(),
        // Text records carry names from traced processes: escaped like the trace's lines, and
        // so without colours (an escape of ours would be shown as `\e` too).
        LogFormat::Text => builder
            .with_writer(|| SafeLogWriter(std::io::stderr()))
            .with_ansi(false)
            .with_target(false)
            .init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli);
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the event loop: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match &cli.command {
            Command::Trace(args) => commands::trace::run(args).await,
            Command::Record(args) => commands::record::run(args).await,
            Command::Report(args) => commands::report::run(args),
            Command::Export(args) => commands::export::run(args),
            Command::Probes(args) => commands::probes::run(args),
            Command::Daemon(args) => commands::daemon::run(args).await,
            Command::Completions(args) => commands::docs::completions(args),
            Command::Man => commands::docs::man(),
            Command::Rules(args) => commands::rules::run(args),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", sinks::terminal::escaped(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}
