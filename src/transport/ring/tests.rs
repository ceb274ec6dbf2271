//! The ring's unit tests.

use super::super::{RecvConn, SendConn};
use super::*;

/// Both ends of a ring inside this process, with slots of `slice` bytes.
fn local_ring(slice: usize) -> (RingSend, RingRecv) {
    let map = Arc::new(Mapping::new(ring_bytes(slice), None).unwrap());
    (RingSend::new(map.clone(), slice, Kind::Local, None), RingRecv::new(map, slice, Kind::Local, None))
}

#[test]
fn messages_flow_in_order_and_fill_up() {
    let slice = 64;
    let (mut tx, mut rx) = local_ring(slice);
    let mut bufs: Vec<Vec<u8>> = (0..SLOTS + 1).map(|i| vec![i as u8; 10]).collect();
    let stamp = [7u8; STAMP_BYTES];
    for b in bufs.iter_mut().take(SLOTS) {
        assert_eq!(tx.try_send(Region::owned(b), &stamp, false).unwrap(), Sent::Done);
    }
    let full = tx.try_send(Region::owned(&mut bufs[SLOTS]), &stamp, false).unwrap();
    assert_eq!(full, Sent::Blocked, "ring must be full");
    let mut got = Vec::new();
    assert!(rx.try_recv(&mut |s, d| { assert_eq!(s, &stamp); got.extend_from_slice(d); Ok(()) }).unwrap());
    assert_eq!(got, vec![0u8; 10]);
    assert_eq!(tx.try_send(Region::owned(&mut bufs[SLOTS]), &stamp, false).unwrap(), Sent::Done);
    let err = rx.try_recv(&mut |_, _| Err(Error::invalid_usage("refused"))).unwrap_err();
    assert_eq!(err.msg, "refused");
}

/// Between CMA_MIN_EARLY and CMA_MIN a message goes by descriptor (read in place) only
/// when the sender says a single copy pays early; below, always inline; and the bytes
/// arrive either way.
#[test]
fn mid_sized_messages_go_in_place_only_when_early() {
    let slice = 1 << 20;
    let (mut tx, mut rx) = local_ring(slice);
    let stamp = [7u8; STAMP_BYTES];
    for (len, early, in_place) in [(CMA_MIN_EARLY - 1, true, false), (CMA_MIN_EARLY, false, false),
                                   (CMA_MIN_EARLY, true, true), (CMA_MIN - 1, false, false),
                                   (CMA_MIN - 1, true, true), (CMA_MIN, false, true)] {
        let mut src: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        let mut dst = vec![0u8; len];
        let sent = tx.try_send(Region::owned(&mut src), &stamp, early).unwrap();
        assert_eq!(matches!(sent, Sent::Posted(_)), in_place, "{len} bytes, early {early}: {sent:?}");
        assert!(rx.try_recv_into(Region::owned(&mut dst), &mut |s, n| { assert_eq!((s, n), (&stamp, len)); Ok(()) })
            .unwrap());
        if let Sent::Posted(token) = sent {
            assert!(tx.consumed(token, false).unwrap(), "read, so consumed");
        }
        assert!(dst == src, "{len} bytes, early {early}: bytes differ");
    }
}

/// A large descriptor is read by both ends: with the sender helping from another thread
/// and with a sender that never helps, every byte lands once and the send completes.
#[test]
fn large_messages_are_read_by_both_ends() {
    let slice = 1 << 20;
    for helping in [true, false] {
        let (mut tx, mut rx) = local_ring(slice);
        for round in 0..3u8 {
            let len = slice - 4096 * round as usize;
            let mut src: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ round).collect();
            let mut dst = vec![0u8; len];
            let stamp = [round; STAMP_BYTES];
            let sent = tx.try_send(Region::owned(&mut src), &stamp, false).unwrap();
            let Sent::Posted(token) = sent else { panic!("not posted: {sent:?}") };
            let dst_region = Region::owned(&mut dst);
            let helper = std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
                while !tx.consumed(token, helping).unwrap() {
                    assert!(std::time::Instant::now() < deadline, "send never completed");
                    std::hint::spin_loop();
                }
                tx
            });
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while !rx.try_recv_into(dst_region, &mut |s, n| { assert_eq!((s, n), (&stamp, len)); Ok(()) }).unwrap() {
                assert!(std::time::Instant::now() < deadline, "receive never completed");
            }
            tx = helper.join().unwrap();
            assert!(dst == src, "round {round}, helping {helping}: bytes differ");
        }
    }
}

/// Several large messages posted at once, growing in size, while the sender helps with
/// whichever is oldest: each lands whole in its own buffer.
#[test]
fn several_posted_messages_are_shared_one_after_another() {
    let slice = 1 << 20;
    let (mut tx, mut rx) = local_ring(slice);
    let lens = [HELP_MIN, HELP_MIN + 3 * HELP_BLOCK + 5, slice];
    let mut srcs: Vec<Vec<u8>> = lens.iter().enumerate().map(|(k, &n)| (0..n).map(|i| (i * 13 + k * 7) as u8).collect()).collect();
    let stamp = [9u8; STAMP_BYTES];
    let tokens: Vec<u64> = srcs.iter_mut().map(|v| match tx.try_send(Region::owned(v), &stamp, false).unwrap() {
        Sent::Posted(t) => t,
        other => panic!("not posted: {other:?}"),
    }).collect();
    let helper = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        for t in tokens {
            while !tx.consumed(t, true).unwrap() {
                assert!(std::time::Instant::now() < deadline, "send {t} never completed");
                std::hint::spin_loop();
            }
        }
    });
    let mut dsts: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
    for (k, d) in dsts.iter_mut().enumerate() {
        let r = Region::owned(d);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !rx.try_recv_into(r, &mut |_, n| { assert_eq!(n, lens[k]); Ok(()) }).unwrap() {
            assert!(std::time::Instant::now() < deadline, "receive {k} never completed");
        }
    }
    helper.join().unwrap();
    for (k, (d, s)) in dsts.iter().zip(&srcs).enumerate() {
        assert!(d == s, "message {k}: bytes differ");
    }
}

#[test]
fn closed_sender_is_reported() {
    let (tx, mut rx) = local_ring(64);
    drop(tx);
    assert!(rx.try_recv(&mut |_, _| Ok(())).is_err());
}
