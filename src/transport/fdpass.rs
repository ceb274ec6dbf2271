//! File descriptors passed between processes of one host (`SCM_RIGHTS` over a Unix socket),
//! for the allocations of the virtual memory API that the direct path shares (`ipc`).
//!
//! A process serves descriptors on an abstract Unix socket of a random name, from one thread
//! per [`Handler`], which makes each descriptor for a request (of [`REQUEST_BYTES`]) when it
//! comes and closes it once sent. A peer asks over one connection ([`Source`]), first proving
//! the process's secret, which only ranks of communicators it belongs to learn (it travels in
//! the direct path's records), and runs as the same user (or root). Unlike `pidfd_getfd`,
//! which PyTorch uses for the same memory, this needs no ptrace access between the processes
//! (Yama's `ptrace_scope`, containers without `CAP_SYS_PTRACE`), only one network namespace.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};

/// How long one side waits for the other's next message.
const PATIENCE: Duration = Duration::from_secs(5);

/// Where a process serves its descriptors, and the secret it asks for: what its ranks publish.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Address {
    pub name: u64,
    pub token: u64,
}

/// The size of one request.
pub const REQUEST_BYTES: usize = 32;

/// Makes the descriptor a request asks for (on the server's thread), or says why not.
pub type Handler = fn(&[u8; REQUEST_BYTES]) -> Result<OwnedFd>;

struct Server {
    handler: Handler,
    address: Address,
}

/// This process's servers, one per handler (a forked child starts its own).
static SERVERS: crate::abi::fork::PerForkMutex<Vec<Arc<Server>>> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);

fn socket_name(name: u64) -> String {
    format!("nccl-rs-fds-{name:016x}")
}

/// Where this process serves the descriptors `handler` makes (the server starts on first use).
pub fn serve(handler: Handler) -> Result<Address> {
    let mut servers = SERVERS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = servers.iter().find(|s| std::ptr::fn_addr_eq(s.handler, handler)) {
        return Ok(s.address);
    }
    let address = Address { name: crate::bootstrap::id::random_u64(), token: crate::bootstrap::id::random_u64() };
    let sys = |what: &str, e: std::io::Error| Error::system(format!("descriptor server: {what}: {e}"));
    let addr = SocketAddr::from_abstract_name(socket_name(address.name)).map_err(|e| sys("address", e))?;
    let listener = crate::abi::stdio::lifted(UnixListener::bind_addr(&addr).map_err(|e| sys("bind", e))?);
    let s = Arc::new(Server { handler, address });
    let serving = s.clone();
    std::thread::Builder::new()
        .name("nccl-rs-fds".into())
        .spawn(move || serve_forever(&serving, &listener))
        .map_err(|e| sys("thread", e))?;
    servers.push(s);
    Ok(address)
}

fn serve_forever(s: &Server, listener: &UnixListener) {
    loop {
        match super::fds::made(|| listener.accept().map(|(conn, _)| conn)) {
            Ok(conn) => {
                // One peer at a time; a peer that stops talking is dropped after PATIENCE.
                let _ = catch_unwind(AssertUnwindSafe(|| s.answer(conn)));
            }
            // Out of descriptors, say: the peer fails and stages; try again shortly.
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

impl Server {
    fn answer(&self, mut conn: UnixStream) -> Result<()> {
        let io = |e: std::io::Error| Error::system(format!("descriptor server: {e}"));
        conn.set_read_timeout(Some(PATIENCE)).map_err(io)?;
        conn.set_write_timeout(Some(PATIENCE)).map_err(io)?;
        if !same_user(&conn) {
            return Ok(());
        }
        let mut token = [0u8; 8];
        conn.read_exact(&mut token).map_err(io)?;
        if u64::from_le_bytes(token) != self.address.token {
            return Ok(());
        }
        let mut request = [0u8; REQUEST_BYTES];
        while conn.read_exact(&mut request).is_ok() {
            // Closed once sent: the peer has its own descriptor then.
            let made = (self.handler)(&request);
            if let Err(e) = &made {
                crate::info!(P2P, "a peer's request for a descriptor refused: {}", e.msg);
            }
            send_fd(&conn, made.as_ref().ok().map(|fd| fd.as_raw_fd())).map_err(io)?;
        }
        Ok(())
    }
}

/// The peer runs as this process's user, or as root.
fn same_user(conn: &UnixStream) -> bool {
    let mut cred = libc::ucred { pid: 0, uid: u32::MAX, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-pointers of the sizes given; the socket is ours.
    let r = unsafe {
        libc::getsockopt(conn.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED,
                         (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    // SAFETY: geteuid has no preconditions.
    r == 0 && (cred.uid == unsafe { libc::geteuid() } || cred.uid == 0)
}

/// One byte (1: here it is, 0: refused) and, with 1, the descriptor.
fn send_fd(conn: &UnixStream, fd: Option<RawFd>) -> std::io::Result<()> {
    let mut status = [fd.is_some() as u8];
    let mut iov = libc::iovec { iov_base: status.as_mut_ptr().cast(), iov_len: 1 };
    let mut control = [0u64; 4]; // CMSG_SPACE(4) is 24 bytes; u64s keep it aligned
    // SAFETY: a zeroed msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: `control` has room for one header with one descriptor (CMSG_SPACE(4) <= 32);
        // CMSG_FIRSTHDR of a msghdr with that buffer points into it.
        unsafe {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(4) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        }
    }
    loop {
        // SAFETY: `msg` describes valid buffers; the socket is ours.
        let n = unsafe { libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        match n {
            1 => return Ok(()),
            _ if interrupted() => continue,
            _ => return Err(std::io::Error::last_os_error()),
        }
    }
}

/// The last call failed with EINTR (a signal arrived): try it again.
fn interrupted() -> bool {
    std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
}

/// The answer to one request: the descriptor, or None if refused.
fn recv_fd(conn: &UnixStream) -> std::io::Result<Option<OwnedFd>> {
    let mut status = [0u8];
    let mut iov = libc::iovec { iov_base: status.as_mut_ptr().cast(), iov_len: 1 };
    let mut control = [0u64; 4];
    // SAFETY: a zeroed msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    let n = loop {
        // SAFETY: `msg` describes valid buffers; received descriptors are close-on-exec.
        let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        match n {
            _ if n >= 0 => break n,
            _ if interrupted() => continue,
            _ => return Err(std::io::Error::last_os_error()),
        }
    };
    if n == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the server closed the connection"));
    }
    // Every descriptor that arrived is owned here (and closed unless it is the one asked for).
    let mut got = Vec::new();
    // SAFETY: walks the control messages recvmsg wrote into `control`, within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize) / 4;
                for k in 0..count {
                    let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>().add(k));
                    got.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        let why = "a descriptor was dropped on the way (out of descriptors?)";
        return Err(std::io::Error::other(why));
    }
    // (Not at 0, 1 or 2, where a log line would write into a peer's file: `abi::stdio::lifted`.)
    Ok(if status[0] == 1 && got.len() == 1 { got.pop().map(crate::abi::stdio::lifted) } else { None })
}

/// A connection to the process serving at an [`Address`], to ask for descriptors one by one.
pub struct Source {
    conn: UnixStream,
    name: String,
}

impl Source {
    pub fn connect(at: Address) -> Result<Source> {
        let name = socket_name(at.name);
        let io = |e: std::io::Error| Error::system(format!("descriptors from {name}: {e}"));
        let mut conn = connect(&name).map_err(|e| {
            Error::system(format!("descriptors from {name}: {e} (the ranks' processes must share a network namespace)"))
        })?;
        conn.write_all(&at.token.to_le_bytes()).map_err(io)?;
        Ok(Source { conn, name })
    }

    /// The descriptor the served process makes for `request`, as a descriptor of this one.
    pub fn get(&mut self, request: &[u8; REQUEST_BYTES]) -> Result<OwnedFd> {
        let name = &self.name;
        let io = |e: std::io::Error| Error::system(format!("descriptors from {name}: {e}"));
        self.conn.write_all(request).map_err(io)?;
        recv_fd(&self.conn).map_err(io)?
            .ok_or_else(|| Error::system(format!("descriptors from {name}: the request was refused")))
    }
}

/// A connection to the abstract socket `name`, within [`PATIENCE`] for every step (a server
/// whose queue of connections is full makes connect wait: the send timeout bounds that too).
fn connect(name: &str) -> std::io::Result<UnixStream> {
    // SAFETY: socket takes no pointers; the descriptor it returns is owned right below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    let conn = crate::abi::stdio::lifted(unsafe { UnixStream::from_raw_fd(fd) });
    conn.set_read_timeout(Some(PATIENCE))?;
    conn.set_write_timeout(Some(PATIENCE))?;
    // SAFETY: a zeroed sockaddr_un is valid; the abstract name goes after a leading NUL.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    if bytes.len() + 1 > addr.sun_path.len() {
        return Err(std::io::Error::other("socket name too long"));
    }
    for (d, &b) in addr.sun_path[1..].iter_mut().zip(bytes) {
        *d = b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + bytes.len();
    loop {
        // SAFETY: `addr` is a valid sockaddr_un of which `len` bytes are used.
        let r = unsafe { libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) };
        match r {
            0 => return Ok(conn),
            _ if interrupted() => continue,
            _ => return Err(std::io::Error::last_os_error()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Serves the files of the test's folder by the name a request holds (NUL-padded).
    fn open_named(request: &[u8; REQUEST_BYTES]) -> Result<OwnedFd> {
        let name: Vec<u8> = request.iter().copied().take_while(|&b| b != 0).collect();
        let path = folder().join(String::from_utf8_lossy(&name).as_ref());
        std::fs::File::open(&path).map(OwnedFd::from).map_err(|e| Error::system(format!("{}: {e}", path.display())))
    }

    fn folder() -> std::path::PathBuf {
        std::env::temp_dir().join(format!("nccl-rs-fdpass-{}", std::process::id()))
    }

    fn request(name: &str) -> [u8; REQUEST_BYTES] {
        let mut r = [0u8; REQUEST_BYTES];
        r[..name.len()].copy_from_slice(name.as_bytes());
        r
    }

    fn inode(fd: &OwnedFd) -> (u64, u64) {
        let m = std::fs::File::from(fd.try_clone().unwrap()).metadata().unwrap();
        (m.dev(), m.ino())
    }

    fn other(_: &[u8; REQUEST_BYTES]) -> Result<OwnedFd> {
        Err(Error::system("nothing here"))
    }

    #[test]
    fn descriptors_are_made_on_request_for_the_secret_only() {
        std::fs::create_dir_all(folder()).unwrap();
        for n in ["a", "b"] {
            std::fs::write(folder().join(n), n).unwrap();
        }
        let at = serve(open_named).unwrap();
        assert_eq!(serve(open_named).unwrap(), at, "one server per handler");
        assert_ne!(serve(other).unwrap(), at, "another handler, another server");
        let mut source = Source::connect(at).unwrap();
        let (a, b) = (source.get(&request("b")).unwrap(), source.get(&request("a")).unwrap());
        let want = |n: &str| {
            let m = std::fs::metadata(folder().join(n)).unwrap();
            (m.dev(), m.ino())
        };
        assert_eq!((inode(&a), inode(&b)), (want("b"), want("a")));
        // What the handler refuses is refused; the connection goes on.
        assert!(source.get(&request("missing")).unwrap_err().msg.contains("refused"));
        assert_eq!(inode(&source.get(&request("a")).unwrap()), want("a"));
        // A wrong secret gets nothing, and where no server is, nothing answers.
        let mut wrong = Source::connect(Address { token: at.token ^ 1, ..at }).unwrap();
        assert!(wrong.get(&request("a")).is_err());
        assert!(Source::connect(Address { name: at.name ^ 1, ..at }).is_err(), "no server there");
        std::fs::remove_dir_all(folder()).unwrap();
    }
}
