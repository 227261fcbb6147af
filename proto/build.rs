//! Generates the CSI bindings. protox compiles the .proto in pure Rust, so a
//! fresh machine needs no protoc binary.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/csi.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
