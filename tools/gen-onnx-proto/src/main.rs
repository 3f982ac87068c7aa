//! Compiles `onnx.proto` with the pure-Rust `protox` compiler and writes the prost types.
//!
//! Usage: `gen-onnx-proto PATH/TO/onnx.proto OUT_DIR`

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args_os().skip(1);
    let proto = PathBuf::from(args.next().ok_or("missing path to onnx.proto")?);
    let out = PathBuf::from(args.next().ok_or("missing output folder")?);
    let include = proto.parent().ok_or("onnx.proto has no parent folder")?;
    let descriptors = protox::compile([&proto], [include])?;
    prost_build::Config::new()
        .out_dir(&out)
        // Initializer bytes as `Bytes`: clones share them, and a memory-mapped external
        // data file is sliced, not copied (`src/onnx/mod.rs`).
        .bytes([".onnx.TensorProto.raw_data"])
        .compile_fds(descriptors)?;
    Ok(())
}
