//! The status a rank shows the peers that ask what it runs: its bytes (a tag, then the calls
//! running, or a failure), kept by [`Ready`](super::Ready), and the answer that carries them
//! with the rank's counts and note ([`Answer`]), read by [`super::diagnose`].

use std::sync::atomic::Ordering;

use super::elsewhere;
use crate::error::Error;
use crate::transport::{Stamp, STAMP_BYTES};

/// A failure as peers hear it (in a failed status, or told: [`super::Comm::tell_failure`]): its code,
/// then its message.
pub(super) fn failure_bytes(e: &Error) -> Vec<u8> {
    let mut bytes = vec![e.code as u8];
    bytes.extend_from_slice(e.msg.as_bytes());
    bytes
}

/// Status bytes a rank publishes: a tag, then stamps (running, or waiting for their streams)
/// or code + message (failed).
pub(super) const STATUS_RUNNING: u8 = 0;
pub(super) const STATUS_FAILED: u8 = 1;
pub(super) const STATUS_STREAM: u8 = 2;
pub(super) const STATUS_SUSPENDED: u8 = 3;
/// Running nothing on this communicator; then, in words, what the process's others run.
pub(super) const STATUS_ELSEWHERE: u8 = 4;
/// In ncclWaitSignal; then, in words, the signals it waits for.
pub(super) const STATUS_SIGNALS: u8 = 5;
/// In place of a send or receive that finished while its group runs on ([`super::Ready::finished`]):
/// no operation's stamp (its first byte is no kind). Never sent: answers leave it out.
pub(super) const DONE: Stamp = [0xFF; STAMP_BYTES];

/// What another rank's status request is answered: the status, or, where this communicator
/// runs nothing, what this process's other communicators run, if anything.
pub(super) fn status_answer(running: &crate::bootstrap::service::Status, serial: u64) -> Vec<u8> {
    let bytes = live_status(&running.lock().unwrap_or_else(|p| p.into_inner()));
    if bytes.len() <= 1 && bytes.first().is_none_or(|&t| t == STATUS_RUNNING) {
        if let Some(text) = elsewhere::running_except(serial) {
            let mut answer = vec![STATUS_ELSEWHERE];
            answer.extend_from_slice(text.as_bytes());
            return answer;
        }
    }
    bytes
}

/// A peer's status answer, read: what it finished with the rank asked about, the collectives it
/// has issued, and what it finished with each rank it runs sends or receives with now (each
/// pair: the sends to that rank and the receives from it the peer has finished), the rank it
/// found holding up its call, in words ([`WaitNote`]), if any, then its status bytes.
#[derive(Debug, PartialEq)]
pub(super) struct Answer<'a> {
    pub(super) about: (u64, u64),
    pub(super) issued: u64,
    pub(super) with: Vec<(usize, (u64, u64))>,
    pub(super) waits: Option<(usize, &'a [u8])>,
    pub(super) status: &'a [u8],
}

impl Answer<'_> {
    /// The bytes [`Answer::read`] reads.
    pub(super) fn write(&self) -> Vec<u8> {
        let note = self.waits.map_or(0, |(_, text)| 4 + text.len());
        let mut bytes = Vec::with_capacity(32 + self.with.len() * 20 + note + self.status.len());
        bytes.extend_from_slice(&self.about.0.to_le_bytes());
        bytes.extend_from_slice(&self.about.1.to_le_bytes());
        bytes.extend_from_slice(&self.issued.to_le_bytes());
        bytes.extend_from_slice(&(self.with.len() as u32).to_le_bytes());
        for &(p, (sent, received)) in &self.with {
            bytes.extend_from_slice(&(p as u32).to_le_bytes());
            bytes.extend_from_slice(&sent.to_le_bytes());
            bytes.extend_from_slice(&received.to_le_bytes());
        }
        bytes.extend_from_slice(&(note as u32).to_le_bytes());
        if let Some((rank, text)) = self.waits {
            bytes.extend_from_slice(&(rank as u32).to_le_bytes());
            bytes.extend_from_slice(text);
        }
        bytes.extend_from_slice(self.status);
        bytes
    }

    pub(super) fn read(answer: &[u8]) -> Answer<'_> {
        let u64_at = |at: usize| answer.get(at..at + 8).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
        let u32_at = |at: usize| answer.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
        let n = u32_at(24).unwrap_or(0) as usize;
        let note_at = 28usize.saturating_add(n.saturating_mul(20));
        let note_len = u32_at(note_at).unwrap_or(0) as usize;
        let start = note_at.saturating_add(4).saturating_add(note_len);
        if answer.len() < start || (note_len > 0 && note_len < 4) {
            // A short answer reads as nothing.
            return Answer { about: (0, 0), issued: 0, with: Vec::new(), waits: None, status: &[] };
        }
        let with = (0..n).map(|i| 28 + i * 20).map(|at| (u32_at(at).unwrap_or(0) as usize, (u64_at(at + 4), u64_at(at + 12))));
        let waits = (note_len > 0).then(|| (u32_at(note_at + 4).unwrap_or(0) as usize, &answer[note_at + 8..start]));
        Answer { about: (u64_at(0), u64_at(8)), issued: u64_at(16), with: with.collect(), waits, status: &answer[start..] }
    }
}

/// The stamps of status bytes (after the tag).
pub(crate) fn status_stamps(bytes: &[u8]) -> impl Iterator<Item = Stamp> + '_ {
    bytes.get(1..).unwrap_or_default().chunks_exact(STAMP_BYTES).filter_map(|s| s.try_into().ok()).filter(|s| *s != DONE)
}

/// [`super::Ready::finished`] on the status bytes.
pub(super) fn mark_finished(bytes: &mut [u8], shown: &Stamp, at: usize) {
    if bytes.first() != Some(&STATUS_RUNNING) {
        return;
    }
    let slot = |k: usize| 1 + k * STAMP_BYTES..1 + (k + 1) * STAMP_BYTES;
    let k = if bytes.get(slot(at)) == Some(shown.as_slice()) {
        Some(at)
    } else {
        bytes.get(1..).unwrap_or_default().chunks_exact(STAMP_BYTES).position(|s| s == shown.as_slice())
    };
    if let Some(place) = k.and_then(|k| bytes.get_mut(slot(k))) {
        place.copy_from_slice(&DONE);
    }
}

/// A copy of a status without the places of finished sends and receives.
fn live_status(bytes: &[u8]) -> Vec<u8> {
    if !matches!(bytes.first(), Some(&STATUS_RUNNING) | Some(&STATUS_STREAM)) {
        return bytes.to_vec();
    }
    let mut live = Vec::with_capacity(bytes.len());
    live.extend(bytes.first());
    status_stamps(bytes).for_each(|s| live.extend_from_slice(&s));
    live
}

/// `tag` and `stamps` as the status, unless it says the rank failed: that stays, for peers
/// that ask why its connections closed (another thread may have failed it meanwhile).
pub(super) fn set_status(bytes: &mut Vec<u8>, tag: u8, stamps: impl Iterator<Item = Stamp>) {
    if bytes.first() == Some(&STATUS_FAILED) {
        return;
    }
    bytes.clear();
    bytes.push(tag);
    stamps.for_each(|s| bytes.extend_from_slice(&s));
}


/// Of per-peer counts (`Ready::p2p_done`): the sends to `peer` and the receives from it.
pub(super) fn finished_with(done: &[[std::sync::atomic::AtomicU64; 2]], peer: usize) -> (u64, u64) {
    done.get(peer).map_or((0, 0), |d| (d[0].load(Ordering::Acquire), d[1].load(Ordering::Acquire)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::diagnose::PeerRuns;
    use crate::comm::ready::{WaitNote, Waits, NOTE_FRESH};
    use crate::error::Code;

    /// A status answer carries what the peer finished with the rank asked about, and with each
    /// rank it runs sends or receives with, ahead of the status.
    #[test]
    fn status_answers_lead_with_the_counts() {
        let sent = Answer { about: (7, 9), issued: 11, with: vec![(4, (2, 3))], waits: None,
                            status: &[STATUS_RUNNING, 1, 2][..] };
        let answer = sent.write();
        assert_eq!(&answer[..16], [7u64.to_le_bytes(), 9u64.to_le_bytes()].concat());
        assert_eq!(Answer::read(&answer), sent);
        let noted = Answer { waits: Some((5, b"rank 5 (h, pid 1), which has not issued that call")),
                             with: sent.with.clone(), ..sent };
        assert_eq!(Answer::read(&noted.write()), noted, "with the rank it waits for");
        let reached = Answer { waits: Some((6, b"")), ..sent };
        assert_eq!(Answer::read(&reached.write()), reached, "or the furthest rank it reached");
        let nothing = Answer { about: (0, 0), issued: 0, with: vec![], waits: None, status: &[][..] };
        assert_eq!(Answer::read(&[1, 2]), nothing, "a short answer reads as nothing");
        assert_eq!(Answer::read(&answer[..30]), nothing, "so does one cut short in its counts");
        assert_eq!(Answer::read(&noted.write()[..60]), nothing, "or in its note");
        let mut huge = answer.clone();
        huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Answer::read(&huge), nothing, "or one that claims more counts than it has");
        let mut long_note = answer.clone();
        long_note[48..52].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Answer::read(&long_note), nothing, "or a longer note");
    }

    #[test]
    fn a_communicator_running_nothing_says_what_the_others_run() {
        let (idle, busy) = (crate::bootstrap::service::Status::default(), crate::bootstrap::service::Status::default());
        let (idle_serial, busy_serial) = (u64::MAX - 1, u64::MAX - 2);
        let (idle_waits, busy_waits) = (Waits::default(), Waits::default());
        elsewhere::enlist(idle_serial, 0x1111, 0, 2, &idle, &idle_waits);
        elsewhere::enlist(busy_serial, 0x2222, 1, 3, &busy, &busy_waits);
        let stamp = [0u8; STAMP_BYTES];
        set_status(&mut busy.lock().unwrap(), STATUS_RUNNING, [stamp].into_iter());
        set_status(&mut idle.lock().unwrap(), STATUS_RUNNING, std::iter::empty());
        let answer = status_answer(&idle, idle_serial);
        let text = String::from_utf8_lossy(&answer[1..]).into_owned();
        assert_eq!(answer[0], STATUS_ELSEWHERE, "{text}");
        assert!(text.contains("on communicator 0x2222 as rank 1 of 3"), "{text}");
        assert!(!text.contains("0x1111"), "{text}");
        assert!(!text.contains("held up"), "{text}");
        // With what holds that call up, while the note is fresh and of that call.
        let note = |stamp: Stamp, at: std::time::Instant| {
            *busy_waits.lock().unwrap() = Some(WaitNote { stamp, rank: 2, text: "rank 2 (h, pid 3), which has not issued \
                                                                               that call".to_string(), at });
            String::from_utf8_lossy(&status_answer(&idle, idle_serial)[1..]).into_owned()
        };
        let held = note(stamp, std::time::Instant::now());
        assert!(held.ends_with("as rank 1 of 3, held up there by rank 2 (h, pid 3), which has not issued that call"),
                "{held}");
        let said = PeerRuns::Elsewhere(held).why_waiting(&stamp, &|_| String::new()).unwrap_or_default();
        assert!(!said.contains("different orders"), "{said}");
        let mut other = stamp;
        other[0] = 1;
        assert!(!note(other, std::time::Instant::now()).contains("held up"), "a note of another call");
        // Nor a note of how far it got (no rank found yet).
        *busy_waits.lock().unwrap() = Some(WaitNote { stamp, rank: 2, text: String::new(), at: std::time::Instant::now() });
        let reached = String::from_utf8_lossy(&status_answer(&idle, idle_serial)[1..]).into_owned();
        assert!(reached.ends_with("as rank 1 of 3"), "{reached}");
        if let Some(stale) = std::time::Instant::now().checked_sub(NOTE_FRESH) {
            assert!(!note(stamp, stale).contains("held up"), "a stale note");
        }
        // A communicator that runs something answers with that, whatever the others run.
        assert_eq!(status_answer(&busy, busy_serial)[0], STATUS_RUNNING);
        drop(busy);
        let after = status_answer(&idle, idle_serial);
        assert!(!String::from_utf8_lossy(&after).contains("0x2222"), "a gone communicator is not named");
    }

    /// A finished send or receive leaves what peers hear of the status, found at the index
    /// given or, where that holds another, by search; once every one finished, the status is
    /// empty, and the communicator answers with what the process's others run.
    #[test]
    fn finished_sends_and_receives_leave_the_status() {
        use crate::plan::ops::with_role;
        let p2p = |bytes: u8| {
            let mut s = [0u8; STAMP_BYTES];
            s[0] = 200; // (ops::P2P_KIND)
            s[8] = bytes;
            s
        };
        let ops = [with_role(p2p(4), true, 1), with_role(p2p(8), false, 1), with_role(p2p(4), false, 2)];
        let running = crate::bootstrap::service::Status::default();
        let serial = u64::MAX - 3;
        elsewhere::enlist(serial, 0x3333, 0, 3, &running, &Waits::default());
        set_status(&mut running.lock().unwrap(), STATUS_RUNNING, ops.iter().copied());
        mark_finished(&mut running.lock().unwrap(), &ops[1], 1);
        let live = |bytes: &[u8]| status_stamps(bytes).collect::<Vec<_>>();
        assert_eq!(live(&status_answer(&running, serial)), [ops[0], ops[2]]);
        // A wrong index: found by search; one not running: nothing changes.
        mark_finished(&mut running.lock().unwrap(), &ops[2], 0);
        mark_finished(&mut running.lock().unwrap(), &with_role(p2p(16), true, 2), 0);
        let answer = status_answer(&running, serial);
        assert_eq!((answer[0], live(&answer)), (STATUS_RUNNING, vec![ops[0]]));
        assert_eq!(answer.len(), 1 + STAMP_BYTES, "finished places are not sent");
        mark_finished(&mut running.lock().unwrap(), &ops[0], 0);
        assert!(live(&running.lock().unwrap()).is_empty());
        assert!(elsewhere::running_except(u64::MAX).is_none_or(|t| !t.contains("0x3333")), "it runs nothing");
        assert_ne!(status_answer(&running, serial).get(1..), Some(&[0xFF; STAMP_BYTES][..]));
    }

    #[test]
    fn a_failed_status_stays() {
        let mut bytes = Vec::new();
        set_status(&mut bytes, STATUS_STREAM, [[7u8; STAMP_BYTES]].into_iter());
        assert_eq!((bytes[0], bytes.len()), (STATUS_STREAM, 1 + STAMP_BYTES));
        set_status(&mut bytes, STATUS_RUNNING, std::iter::empty());
        assert_eq!(bytes, vec![STATUS_RUNNING]);
        bytes = vec![STATUS_FAILED, Code::UnhandledCudaError as u8, b'x'];
        set_status(&mut bytes, STATUS_RUNNING, std::iter::empty());
        set_status(&mut bytes, STATUS_STREAM, [[1u8; STAMP_BYTES]].into_iter());
        assert_eq!(bytes, vec![STATUS_FAILED, Code::UnhandledCudaError as u8, b'x'], "the failure is what peers hear");
    }
}
