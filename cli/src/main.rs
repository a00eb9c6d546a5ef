//! `ferry`: thin glue over Ferry's libraries for operators.
//!
//! Logging goes to stderr and follows FERRY_LOG (env_logger syntax, e.g.
//! `FERRY_LOG=info` or `FERRY_LOG=ferry=debug`); the default shows warnings.

use clap::{Parser, Subcommand};
use ferry_core::host::CoreHost;
use ferry_core::info::InfoReport;
use ferry_loader::LoaderConfig;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "Ferry moves KV-cache blocks and tensors between GPU and host memory across a cluster.",
    long_about = "Ferry moves KV-cache blocks and tensors between GPU and host memory across a \
cluster. Plugins (transports such as tcp, shm, rdma; devices such as cuda) are found at run \
time, so one build runs on every node.\n\nEnvironment:\n  FERRY_PLUGIN_PATH   colon list of \
plugin directories or files, searched first\n  FERRY_TRANSPORTS    allow list (tcp,shm) or deny \
list (^rdma) of transports\n  FERRY_PLUGIN_PROBE_TIMEOUT_MS  how long one plugin's probe may \
take (default 10000)\n  FERRY_LOG           log filter (default warn), e.g. info or \
ferry=debug"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show this build, the plugin search path and every plugin with its state and why.
    ///
    /// Exit status is 0 whatever the plugins' states: a disabled plugin is information,
    /// not a failure.
    Info {
        /// Print JSON (shape documented in docs/info-json.md).
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::new().filter_or("FERRY_LOG", "warn"))
        .format_timestamp_millis()
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Info { json } => info(json),
    }
}

fn info(json: bool) -> ExitCode {
    let set = ferry_core::load_plugins(&LoaderConfig::from_env(), CoreHost::default());
    let report = InfoReport::from_plugins(&set);
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("ferry: cannot print the report: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        print!("{}", report.render_text());
    }
    ExitCode::SUCCESS
}
