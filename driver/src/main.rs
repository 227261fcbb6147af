use fencecsi_driver::config::Config;

#[tokio::main]
async fn main() {
    let cfg = Config::from_command_line(std::env::args_os()).unwrap_or_else(|e| e.exit());
    fencecsi_cluster::cli::init_logging(cfg.log_format, "info");
    if let Err(e) =
        fencecsi_driver::server::serve(cfg, fencecsi_driver::server::shutdown_signal()).await
    {
        tracing::error!(error = %e, "fencecsi-driver failed");
        eprintln!("fencecsi-driver: {e}");
        std::process::exit(1);
    }
}
