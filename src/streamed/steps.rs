//! CUDA mode: queueing a direct operation's steps on its caller's stream (see `board`): which
//! kernels a collective needs there, the board slots of a call's operations, and each step —
//! gate, kernels, flag — as the stream will run it.

use std::sync::atomic::Ordering;

use super::board::{self, Ticket};
use super::Prepared;
use crate::comm::Comm;
use crate::device::cuda::{Indirect, KeepCurrent, MemOp, WaitCond};
use crate::error::{Error, Result};
use crate::plan::Op;
use super::OnStream;
use crate::transport::ipc;

/// The kernels a direct collective queues on its caller's stream, if the board can hold them.
pub(super) fn on_stream_shape(comm: &Comm, op: &Op) -> Option<ipc::Shape> {
    if op.kind.is_p2p() {
        return None;
    }
    let shape = ipc::shape(comm, op);
    let fits = !shape.is_empty() && shape.len() <= board::PHASES
        && shape.iter().map(Vec::len).sum::<usize>() <= board::DESCS;
    fits.then_some(shape)
}

/// The kernel a direct receive queues on its caller's stream: one copy from the sender's
/// buffer, whose address the worker fills in. Only into memory the kernel surely reaches by
/// its address: device memory, or pinned host memory mapped there as it is (a copy out of a
/// mapped peer buffer into pinned memory on the worker's stream would be device work of a host
/// thread, which can sit behind the caller's stream waiting for it). Other memory (managed,
/// pinned at another device address) is copied on the worker's stream.
pub(super) fn receive_shape(op: &Op) -> Option<ipc::Shape> {
    let reached = op.kind == crate::plan::OpKind::Recv && !op.recv.is_empty()
        && crate::device::cuda::device_reaches_as_is(op.recv.addr(), op.recv.len());
    reached.then(|| vec![vec![(op.recv.len(), Indirect::Copy)]])
}

/// One step a caller's stream runs of a direct operation (`board`): wait for the gate, run
/// the kernels (address of the first descriptor, grid size, which kernel, how many
/// descriptors side by side), raise the flag.
pub(super) struct Step {
    caller: usize,
    ticket: Ticket,
    gate: u32,
    kernels: Vec<(usize, usize, Indirect, usize)>,
    flag: Option<u32>,
}

/// The launches of one phase: consecutive copies together (they write disjoint outputs, and
/// one launch runs them side by side), every reduction on its own (each may read the last
/// one's result). Per launch: first descriptor, largest grid size, kernel, descriptors.
fn launches(phase: &ipc::Phase) -> Vec<(usize, usize, Indirect, usize)> {
    let mut out: Vec<(usize, usize, Indirect, usize)> = Vec::new();
    for (j, &(n, kind)) in phase.iter().enumerate() {
        match out.last_mut() {
            Some((_, most, Indirect::Copy, rows)) if kind == Indirect::Copy => {
                *most = (*most).max(n);
                *rows += 1;
            }
            _ => out.push((j, n, kind, 1)),
        }
    }
    out
}

impl Prepared {
    /// Slots of the board for the direct operations (one without a slot runs on the worker's
    /// stream), and the steps their streams run.
    pub(super) fn take_slots(&mut self) -> Vec<Step> {
        let s = self.lock.0.clone();
        // (Only operations that may go on their streams have a shape.)
        let Some(board) = s.board.as_ref() else { return Vec::new() };
        let mut steps = Vec::new();
        self.direct = self.shapes.iter_mut().map(|sh| {
            let shape = sh.take()?;
            let Some(ticket) = board.take(shape.len(), shape.iter().map(Vec::len).sum()) else {
                if !s.slots_ran_out.swap(true, Ordering::Relaxed) {
                    crate::info!(P2P, "rank {}: {} direct operations queued ahead of their streams: no free slot \
                                       on the board, later ones run on the worker's stream until slots free up",
                                 self.comm.rank, board::SLOTS);
                }
                return None;
            };
            Some(OnStream { ticket, shape })
        }).collect();
        // In the order the worker opens their gates: the collectives, in issue order, then the
        // sends and receives (`worker::run_batch`). A receive's step queued ahead of a
        // collective's on the same stream would hold that stream at a gate the worker opens
        // only after the collective's, whose flag it waits for.
        let p2p_last = |i: &usize| self.ops.get(*i).is_some_and(|o| o.kind.is_p2p());
        let mut order: Vec<usize> = (0..self.direct.len()).collect();
        order.sort_by_key(p2p_last);
        for i in order {
            let Some(d) = &self.direct[i] else { continue };
            let mut first = 0;
            for (k, phase) in d.shape.iter().enumerate() {
                let value = d.ticket.step_value(k + 1);
                let kernels = launches(phase).into_iter()
                    .map(|(j, n, kind, rows)| (board.desc_addr(&d.ticket, first + j), n, kind, rows))
                    .collect();
                first += phase.len();
                steps.push(Step { caller: self.caller_of[i], ticket: d.ticket, gate: value, kernels, flag: Some(value) });
            }
            steps.push(Step { caller: self.caller_of[i], ticket: d.ticket, gate: d.ticket.final_gate(), kernels: Vec::new(),
                              flag: None });
        }
        steps
    }

    /// Queues one step on its caller's stream.
    pub(super) fn enqueue_step(&self, step: &Step) -> Result<()> {
        let _keep = KeepCurrent::new();
        let s = &self.lock.0;
        s.ctx.make_current()?;
        let (Some(board), Some(kernels)) = (&s.board, s.kernels) else {
            return Err(Error::internal("a direct operation's step without a board"));
        };
        let st = &self.callers[step.caller];
        let gate = board.gate_word(&step.ticket);
        let gated = match s.gate_kernel {
            Some(k) => k.wait_geq(st, board.mem(), gate, step.gate).map(|()| MemOp::Enqueued),
            None => st.wait_value32(board.mem(), gate, step.gate, WaitCond::Geq),
        };
        let refused = || Error::system("the driver refused a stream memory operation it reported as supported");
        if gated? == MemOp::Unsupported {
            return Err(refused());
        }
        for &(descs, n, kind, rows) in &step.kernels {
            kernels.indirect(st, descs, n, kind, rows)?;
        }
        if let Some(v) = step.flag {
            if st.write_value32(board.mem(), board.flag_word(&step.ticket), v)? == MemOp::Unsupported {
                return Err(refused());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::launches;
    use crate::device::cuda::Indirect::{Copy, Of};
    use crate::types::DataType::Float32;

    /// Consecutive copies share a launch (the largest grid); each reduction has its own.
    #[test]
    fn copies_of_a_phase_share_a_launch() {
        let phase = vec![(10, Of(Float32)), (10, Of(Float32)), (7, Copy), (9, Copy), (3, Copy), (5, Of(Float32)), (2, Copy)];
        assert_eq!(launches(&phase),
                   vec![(0, 10, Of(Float32), 1), (1, 10, Of(Float32), 1), (2, 9, Copy, 3), (5, 5, Of(Float32), 1),
                        (6, 2, Copy, 1)]);
        assert!(launches(&Vec::new()).is_empty());
    }
}
