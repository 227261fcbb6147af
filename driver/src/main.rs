use clap::Parser;
use fencecsi_driver::config::{Config, LogFormat};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() {
    let cfg = Config::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match cfg.log_format {
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init(),
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init(),
    }
    if let Err(e) =
        fencecsi_driver::server::serve(cfg, fencecsi_driver::server::shutdown_signal()).await
    {
        tracing::error!(error = %e, "fencecsi-driver failed");
        eprintln!("fencecsi-driver: {e}");
        std::process::exit(1);
    }
}
