//! ONNX Runtime's log through `tracing`, so a service sees it where it sees its own (and
//! nothing goes straight to stderr). Events have the target `onnxruntime`; ONNX Runtime's
//! levels map to `tracing`'s as verbose -> TRACE, info -> DEBUG (its info is a narrative
//! of its internals: sessions, graph passes), warning -> WARN, error and fatal -> ERROR.
//! ONNX Runtime formats only what the subscriber in place when it loads would show (its
//! level is set from `tracing`'s maximum then).

use std::sync::Arc;

use ort::logging::{LogLevel, LoggerFunction};
use ort::AsPointer;
use tracing::level_filters::LevelFilter;

use crate::Result;

/// Hands each message of ONNX Runtime to `tracing`.
pub(super) fn logger() -> LoggerFunction {
    Arc::new(|level, category, id, location, message| match level {
        LogLevel::Verbose => {
            tracing::trace!(target: "onnxruntime", category, id, location, "{message}")
        }
        LogLevel::Info => {
            tracing::debug!(target: "onnxruntime", category, id, location, "{message}")
        }
        LogLevel::Warning => {
            tracing::warn!(target: "onnxruntime", category, id, location, "{message}")
        }
        LogLevel::Error | LogLevel::Fatal => {
            tracing::error!(target: "onnxruntime", category, id, location, "{message}")
        }
    })
}

/// ONNX Runtime's level for what `tracing` shows now.
fn ort_level(max: LevelFilter) -> ort::sys::OrtLoggingLevel {
    use ort::sys::OrtLoggingLevel as L;
    if max >= LevelFilter::TRACE {
        L::ORT_LOGGING_LEVEL_VERBOSE
    } else if max >= LevelFilter::DEBUG {
        L::ORT_LOGGING_LEVEL_INFO
    } else if max >= LevelFilter::WARN {
        L::ORT_LOGGING_LEVEL_WARNING
    } else if max >= LevelFilter::ERROR {
        L::ORT_LOGGING_LEVEL_ERROR
    } else {
        L::ORT_LOGGING_LEVEL_FATAL
    }
}

/// Sets `env`'s level to what `tracing` shows (the logger's environment is created at
/// verbose: every message would be formatted and handed over only to be dropped).
pub(super) fn set_level(env: &ort::environment::Environment) -> Result<()> {
    let api = ort::api();
    let level = ort_level(LevelFilter::current());
    // SAFETY: `env` is the live environment; the call only stores the level.
    let status = unsafe { (api.UpdateEnvWithCustomLogLevel)(env.ptr().cast_mut(), level) };
    super::arena::check(status, "setting ONNX Runtime's log level")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_follow_what_tracing_shows() {
        use ort::sys::OrtLoggingLevel as L;
        assert_eq!(ort_level(LevelFilter::TRACE), L::ORT_LOGGING_LEVEL_VERBOSE);
        assert_eq!(ort_level(LevelFilter::DEBUG), L::ORT_LOGGING_LEVEL_INFO);
        assert_eq!(ort_level(LevelFilter::INFO), L::ORT_LOGGING_LEVEL_WARNING);
        assert_eq!(ort_level(LevelFilter::WARN), L::ORT_LOGGING_LEVEL_WARNING);
        assert_eq!(ort_level(LevelFilter::OFF), L::ORT_LOGGING_LEVEL_FATAL);
    }
}
