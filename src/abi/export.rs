//! The `export!` macro: one definition gives `ncclX`, `pncclX` and the signature record that
//! the drift test compares with `include/nccl.h`.

/// ```ignore
/// export! {
///     fn ncclFoo(comm: ncclComm_t, out: *mut c_int) { api::foo(...) }            // -> ncclResult_t
///     fn ncclBar(comm: ncclComm_t) -> c_int = -1; { api::bar(...) }            // value, fallback on error
/// }
/// ```
macro_rules! export {
    ($(
        $(#[$meta:meta])*
        fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty = $fallback:expr ;)? $body:block
    )*) => {
        $( export!(@one $(#[$meta])* $name ( $($arg : $ty),* ) $(-> $ret = $fallback ,)? $body); )*

        #[cfg(test)]
        pub(crate) fn signatures() -> Vec<$crate::abi::ctype::Sig> {
            vec![$(
                $crate::abi::ctype::Sig {
                    name: stringify!($name),
                    ret: export!(@retname $($ret)?),
                    args: vec![$( (stringify!($arg), <$ty as $crate::abi::ctype::CType>::C) ),*],
                }
            ),*]
        }
    };

    (@retname) => { "ncclResult_t" };
    (@retname $ret:ty) => { <$ret as $crate::abi::ctype::CType>::C };

    (@one $(#[$meta:meta])* $name:ident ( $($arg:ident : $ty:ty),* ) $body:block) => {
        paste::paste! {
            $(#[$meta])*
            #[no_mangle]
            pub extern "C" fn $name($($arg: $ty),*) -> $crate::abi::ncclResult_t {
                $crate::abi::boundary(stringify!($name), move || $body)
            }
            #[doc = concat!("Profiling alias of [`", stringify!($name), "`].")]
            #[no_mangle]
            pub extern "C" fn [<p $name>]($($arg: $ty),*) -> $crate::abi::ncclResult_t {
                $name($($arg),*)
            }
        }
    };

    (@one $(#[$meta:meta])* $name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty = $fallback:expr, $body:block) => {
        paste::paste! {
            $(#[$meta])*
            #[no_mangle]
            pub extern "C" fn $name($($arg: $ty),*) -> $ret {
                $crate::abi::boundary_value(stringify!($name), $fallback, move || $body)
            }
            #[doc = concat!("Profiling alias of [`", stringify!($name), "`].")]
            #[no_mangle]
            pub extern "C" fn [<p $name>]($($arg: $ty),*) -> $ret {
                $name($($arg),*)
            }
        }
    };
}
