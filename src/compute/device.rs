//! Where a run computes: `[runtime] device = "cpu" | "cuda" | "cuda:N"`.
//!
//! Asking for a GPU checks, before anything else, that the CUDA driver library can be
//! opened and has the device: a machine without one gets an error naming the setting,
//! never a panic (cudarc's context constructor panics when the driver is missing, so the
//! probe opens `libcuda` itself with `libloading` and asks it through the driver API's
//! stable C entry points `cuInit`, `cuDeviceGetCount` and `cuDeviceGetName`).
//!
//! The CUDA path (ONNX Runtime's CUDA provider on a stream each session owns, NCCL; see
//! `compute/cuda.rs`) is in builds with `--features cuda`; a build without it refuses a
//! present GPU saying so, rather than silently training on the CPU.

use std::fmt;
use std::os::raw::{c_char, c_int, c_uint};

use serde::{Deserialize, Deserializer};

/// A compute device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Device {
    /// ONNX Runtime's CPU provider.
    #[default]
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

impl Device {
    /// Parses `cpu`, `cuda` (device 0) or `cuda:N`.
    ///
    /// # Errors
    /// What is wrong with `text`, in words.
    pub fn parse(text: &str) -> Result<Device, String> {
        match text.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            t => match t.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                Some(Err(_)) => Err(format!(
                    "`{t}`: the device index after `cuda:` must be a number (`cuda:0`)"
                )),
                None => Err(format!(
                    "`{t}` is not a device; use \"cpu\", \"cuda\" or \"cuda:N\""
                )),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Device, D::Error> {
        let text = String::deserialize(d)?;
        Device::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// The CUDA devices the driver reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDevices {
    /// The driver library that answered.
    pub library: String,
    /// The devices' names, by index.
    pub names: Vec<String>,
}

/// The driver library's names, most specific first.
const DRIVER_LIBRARIES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Asks the CUDA driver for its devices.
///
/// # Errors
/// Why there are none to be had, in words: no driver library, or the driver failing to
/// start (its error code).
pub fn cuda_devices() -> Result<CudaDevices, String> {
    let (library, lib) = DRIVER_LIBRARIES
        .iter()
        // SAFETY: loading the CUDA driver runs its initialisers, which have no
        // preconditions on the caller.
        .find_map(|name| {
            unsafe { libloading::Library::new(*name) }
                .ok()
                .map(|l| (*name, l))
        })
        .ok_or_else(|| {
            format!(
                "no CUDA driver on this machine ({} not found)",
                DRIVER_LIBRARIES.join(", ")
            )
        })?;
    type Init = unsafe extern "C" fn(c_uint) -> c_int;
    type Count = unsafe extern "C" fn(*mut c_int) -> c_int;
    type Name = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    let missing = |e: libloading::Error| format!("{library}: {e}");
    // SAFETY: the symbols are the driver API's, with the C signatures declared above
    // (cuda.h: CUresult cuInit(unsigned int), cuDeviceGetCount(int*),
    // cuDeviceGetName(char*, int, CUdevice)).
    unsafe {
        let init: libloading::Symbol<Init> = lib.get(b"cuInit\0").map_err(missing)?;
        let count: libloading::Symbol<Count> = lib.get(b"cuDeviceGetCount\0").map_err(missing)?;
        let name: libloading::Symbol<Name> = lib.get(b"cuDeviceGetName\0").map_err(missing)?;
        let code = init(0);
        if code != 0 {
            return Err(format!("{library}: cuInit failed with CUDA error {code}"));
        }
        let mut n: c_int = 0;
        let code = count(&mut n);
        if code != 0 {
            return Err(format!(
                "{library}: cuDeviceGetCount failed with CUDA error {code}"
            ));
        }
        let mut names = Vec::new();
        for i in 0..n {
            let mut buf = [0 as c_char; 256];
            let text = match name(buf.as_mut_ptr(), buf.len() as c_int, i) {
                0 => std::ffi::CStr::from_ptr(buf.as_ptr())
                    .to_string_lossy()
                    .into_owned(),
                code => format!("(name unknown: CUDA error {code})"),
            };
            names.push(text);
        }
        Ok(CudaDevices {
            library: library.to_owned(),
            names,
        })
    }
}

/// Whether a run on `device` can start here: the CPU always; a GPU when the driver has
/// it and this build has the CUDA path (`--features cuda`).
///
/// # Errors
/// Why not, in words, for the caller to attach to the setting.
pub fn check_device(device: Device) -> Result<(), String> {
    let Device::Cuda(index) = device else {
        return Ok(());
    };
    let found = cuda_devices()?;
    match found.names.get(index) {
        None => Err(format!(
            "{device} asked for, but the driver ({}) has {} device(s){}",
            found.library,
            found.names.len(),
            match found.names.len() {
                0 => String::new(),
                n => format!(": cuda:0..cuda:{}", n - 1),
            }
        )),
        Some(_) if cfg!(feature = "cuda") => Ok(()),
        Some(name) => Err(format!(
            "{device} ({name}) is present, but this build trains on the CPU only: build pipetrain with `--features cuda` (and ONNX Runtime's CUDA build: `scripts/setup.sh --cuda`), or use device = \"cpu\""
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_from_their_names_and_bad_names_say_why() {
        assert_eq!(Device::parse("cpu"), Ok(Device::Cpu));
        assert_eq!(Device::parse("cuda"), Ok(Device::Cuda(0)));
        assert_eq!(Device::parse("cuda:3"), Ok(Device::Cuda(3)));
        assert!(Device::parse("cuda:x")
            .unwrap_err()
            .contains("must be a number"));
        assert!(Device::parse("tpu")
            .unwrap_err()
            .contains("\"cpu\", \"cuda\" or \"cuda:N\""));
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
    }
}
