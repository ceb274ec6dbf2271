//! `NCCL_SOCKET_IFNAME` / `NCCL_SOCKET_FAMILY` that leave no interface make `ncclGetUniqueId`
//! (and every init) fail with `ncclInvalidArgument` naming the setting and this host's
//! interfaces, as NCCL's "no socket interface found": falling back to loopback instead would
//! leave every other host unable to reach this one, a hang whose cause is a typo.
//!
//! A test binary of its own: it changes the process's environment.

use nccl::bootstrap::new_unique_id;
use nccl::error::Code;

fn with_env(vars: &[(&str, Option<&str>)]) {
    for (k, v) in vars {
        match v {
            Some(v) => std::env::set_var(k, v),
            None => std::env::remove_var(k),
        }
    }
    nccl::params::reload();
}

#[test]
fn socket_settings_that_leave_no_interface_are_refused() {
    with_env(&[("NCCL_SOCKET_IFNAME", None), ("NCCL_SOCKET_FAMILY", None), ("NCCL_COMM_ID", None)]);
    assert!(new_unique_id().is_ok(), "with no setting, some interface (loopback at worst) serves");
    with_env(&[("NCCL_SOCKET_IFNAME", Some("lo"))]);
    assert!(new_unique_id().is_ok(), "NCCL_SOCKET_IFNAME=lo: loopback serves");

    // A name no interface has; an exact name ("=") that is only a prefix of one.
    for name in ["nccl-rs-no-such-if", "=l"] {
        with_env(&[("NCCL_SOCKET_IFNAME", Some(name))]);
        let e = match new_unique_id() {
            Ok(_) => panic!("NCCL_SOCKET_IFNAME={name} gave a unique id"),
            Err(e) => e,
        };
        assert_eq!(e.code, Code::InvalidArgument, "{}", e.msg);
        let setting = format!("NCCL_SOCKET_IFNAME={name}");
        assert!(e.msg.contains("no socket interface found") && e.msg.contains(&setting) && e.msg.contains("lo 127.0.0.1"),
                "the refusal does not name the setting and the interfaces: {}", e.msg);
    }
}
