//! The crate-wide error: an NCCL result code plus a message that says what happened and, where
//! it helps, what to do. Internal code returns `Result<T>`; the C boundary maps it once onto
//! `ncclResult_t` and records the message for `ncclGetLastError`.

use std::fmt;

use crate::abi::fork::{PerFork, PerForkMutex};

/// NCCL's result codes, with NCCL's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Code {
    Success = 0,
    UnhandledCudaError = 1,
    SystemError = 2,
    InternalError = 3,
    InvalidArgument = 4,
    InvalidUsage = 5,
    RemoteError = 6,
    InProgress = 7,
    Timeout = 8,
}

impl Code {
    pub fn from_raw(v: i32) -> Option<Code> {
        Some(match v {
            0 => Code::Success,
            1 => Code::UnhandledCudaError,
            2 => Code::SystemError,
            3 => Code::InternalError,
            4 => Code::InvalidArgument,
            5 => Code::InvalidUsage,
            6 => Code::RemoteError,
            7 => Code::InProgress,
            8 => Code::Timeout,
            _ => return None,
        })
    }

    /// The same strings as NVIDIA's `ncclGetErrorString`, so logs grep the same.
    pub fn describe(self) -> &'static str {
        match self {
            Code::Success => "no error",
            Code::UnhandledCudaError => "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
            Code::SystemError => "unhandled system error (run with NCCL_DEBUG=INFO for details)",
            Code::InternalError => "internal error - please report this issue to the NCCL developers",
            Code::InvalidArgument => "invalid argument (run with NCCL_DEBUG=WARN for details)",
            Code::InvalidUsage => "invalid usage (run with NCCL_DEBUG=WARN for details)",
            Code::RemoteError => "remote process exited or there was a network error",
            Code::InProgress => "NCCL operation in progress",
            Code::Timeout => "NCCL operation timed out",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub code: Code,
    pub msg: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(code: Code, msg: impl Into<String>) -> Error {
        Error { code, msg: msg.into() }
    }
    pub fn invalid_arg(msg: impl Into<String>) -> Error {
        Error::new(Code::InvalidArgument, msg)
    }
    pub fn invalid_usage(msg: impl Into<String>) -> Error {
        Error::new(Code::InvalidUsage, msg)
    }
    pub fn internal(msg: impl Into<String>) -> Error {
        Error::new(Code::InternalError, msg)
    }
    pub fn system(msg: impl Into<String>) -> Error {
        Error::new(Code::SystemError, msg)
    }
    pub fn remote(msg: impl Into<String>) -> Error {
        Error::new(Code::RemoteError, msg)
    }
    pub fn timeout(msg: impl Into<String>) -> Error {
        Error::new(Code::Timeout, msg)
    }
    /// Not an error for the caller: a nonblocking communicator is still working.
    pub fn in_progress() -> Error {
        Error::new(Code::InProgress, "operation in progress")
    }
    pub fn not_implemented(what: &str) -> Error {
        Error::invalid_usage(format!("{what} is not implemented by nccl-rs yet"))
    }
    /// An OS error, with what we were doing when it happened.
    pub fn os(context: impl fmt::Display, e: std::io::Error) -> Error {
        let context = context.to_string();
        let hint = if context.contains("spawn") && e.raw_os_error() == Some(libc::EAGAIN) {
            " (no thread could be started: the process, or its user, is at its limit of threads: `ulimit -u`, or the \
             container's pids limit)".to_string()
        } else {
            crate::transport::fds::hint(&e)
        };
        Error::system(format!("{context}: {e}{hint}"))
    }
    /// Prefix the message with more context (outermost first).
    pub fn context(mut self, ctx: impl fmt::Display) -> Error {
        self.msg = format!("{ctx}: {}", self.msg);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

/// `ensure!(cond, Error::...)`: return the error when the condition does not hold.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $err:expr) => {
        if !$cond {
            return Err($err);
        }
    };
}

/// The last error message, process-wide as in NCCL (`ncclGetLastError`), NUL-terminated in
/// a static buffer: the pointer handed out is never freed, only overwritten by a later error.
/// A forked child keeps its parent's unless a thread was setting it at the fork.
static LAST_ERROR: PerForkMutex<LastError> = PerFork::new(crate::abi::fork::inherit);

#[derive(Clone)]
struct LastError([u8; 1024]);

impl Default for LastError {
    fn default() -> Self {
        LastError([0; 1024])
    }
}

pub fn set_last_error(text: &str) {
    let buf = &mut LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()).0;
    let bytes: Vec<u8> = text.bytes().filter(|&b| b != 0).take(buf.len() - 1).collect();
    buf[..bytes.len()].copy_from_slice(&bytes);
    buf[bytes.len()] = 0;
}

pub fn last_error_ptr() -> *const u8 {
    LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()).0.as_ptr()
}
