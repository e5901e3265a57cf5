use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::{fmt, EnvFilter};
use xtlock::{
    cli::{Cli, Command, LogFormat},
    commands,
};

fn init_logging(cli: &Cli) {
    let default = match cli.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // Logs always go to stderr: stdout carries the trace (and JSON) only.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match cli.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.with_target(false).init(),
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
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
