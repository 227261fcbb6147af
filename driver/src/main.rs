use fencecsi_driver::config::Config;
use fencecsi_driver::server::{serve_with, shutdown_signal, ServeHooks};

#[tokio::main]
async fn main() {
    let cfg = Config::from_command_line(std::env::args_os()).unwrap_or_else(|e| e.exit());
    fencecsi_cluster::cli::init_logging(cfg.log_format, "info");
    // This process may be killed by a successor that leads (see ServeHooks::kill_switch).
    let hooks = ServeHooks {
        kill_switch: true,
        ..Default::default()
    };
    if let Err(e) = serve_with(cfg, shutdown_signal(), hooks).await {
        tracing::error!(error = %e, "fencecsi-driver failed");
        eprintln!("fencecsi-driver: {e}");
        std::process::exit(1);
    }
}
