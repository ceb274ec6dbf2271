//! Wall-clock time as C's `strftime` writes it in the local time zone (`TZ` honoured), for the
//! timestamps NCCL puts in front of log lines (`NCCL_DEBUG_TIMESTAMP_FORMAT`).

use std::time::{SystemTime, UNIX_EPOCH};

/// `format` as NCCL reads it, at `at`: strftime's conversions, plus `%Nf` (N one digit 1-9:
/// the first N digits of the fraction of a second), and `_` written as a space (NCCL 2.26).
/// An empty result if the time cannot be converted.
pub(crate) fn local_strftime(format: &str, at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let nanos = format!("{:09}", since.subsec_nanos());
    // %Nf first (strftime does not know it), then underscores; "%%" stays strftime's.
    let mut fmt = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '%' => match chars.peek().copied() {
                Some('%') => {
                    chars.next();
                    fmt.push_str("%%");
                }
                Some(d @ '1'..='9') => {
                    let mut ahead = chars.clone();
                    ahead.next();
                    if ahead.peek() == Some(&'f') {
                        chars.next();
                        chars.next();
                        fmt.push_str(&nanos[..d as usize - '0' as usize]);
                    } else {
                        fmt.push('%');
                    }
                }
                _ => fmt.push('%'),
            },
            '_' => fmt.push(' '),
            '\0' => {}
            c => fmt.push(c),
        }
    }
    if fmt.is_empty() {
        return String::new();
    }
    let Ok(cfmt) = std::ffi::CString::new(fmt) else { return String::new() };
    let secs = since.as_secs() as libc::time_t;
    // SAFETY: an all-zero `tm` is a valid value for localtime_r to overwrite.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals; localtime_r is the thread-safe form.
    if unsafe { libc::localtime_r(&secs, &mut tm) }.is_null() {
        return String::new();
    }
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its length, `cfmt` is NUL-terminated and `tm` was filled
    // in above; strftime writes at most `buf.len()` bytes and returns how many (0: too long).
    let n = unsafe { libc::strftime(buf.as_mut_ptr().cast(), buf.len(), cfmt.as_ptr(), &tm) };
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn fractions_underscores_and_the_default_shape() {
        let at = UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
        assert_eq!(local_strftime("%3f|%9f|%1f", at), "123|123456789|1");
        assert_eq!(local_strftime("a_b%%3f", at), "a b%3f");
        assert_eq!(local_strftime("", at), "");
        // "[%F %T] ": "[YYYY-MM-DD HH:MM:SS] " whatever the zone.
        let s = local_strftime("[%F %T] ", at);
        let b = s.as_bytes();
        assert_eq!(s.len(), 22, "{s:?}");
        assert!(b[0] == b'[' && b[5] == b'-' && b[8] == b'-' && b[11] == b' ' && b[14] == b':' && b[20] == b']', "{s:?}");
    }
}
