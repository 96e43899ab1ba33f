//! The GPT's weights in the compute type: a step's kept casts, and with unit casts one cast per
//! block that its linear layers take 16-bit leaves from.

use tch::{Kind, Tensor};

use super::parts::{Gpt, Slot};
use crate::params::{ParamEntry, UnitRange};

impl Gpt {
    /// Starts a step's casts of the weights to the compute type: drops the previous step's
    /// (the parameters have changed since), and with `reuse` keeps each cast made with autograd
    /// on for the step's later micro-batches, so a step of k accumulated micro-batches casts each
    /// weight once instead of k times. The kept cast stays in every micro-batch's graph: its
    /// backward (the cast's, which saves no tensor, so it can run once per micro-batch) adds each
    /// micro-batch's gradient into the fp32 master's, as before. With one micro-batch there is
    /// nothing to reuse, and keeping them would only hold memory (under recomputation, or a
    /// ZeRO stage-3 step that releases the parameters) until `end_step_casts`.
    pub fn begin_step_casts(&mut self, reuse: bool) {
        self.end_step_casts();
        self.reuse_casts = reuse && self.compute != Kind::Float;
    }

    /// Drops the step's kept casts (before the optimizer changes the weights).
    pub fn end_step_casts(&mut self) {
        self.casts.get_mut().iter_mut().for_each(|cast| *cast = None);
        self.block_casts.get_mut().iter_mut().for_each(|cast| *cast = None);
        // Leaves are left only by a micro-batch that stopped between its forward and backward.
        self.leaves.get_mut().iter_mut().for_each(|leaf| *leaf = None);
        self.reuse_casts = false;
    }

    /// Adds the gradients of the 16-bit leaves a backward just reached (block `layer_idx`'s, or
    /// with `None` the head's tied embedding) into the fp32 gradient buffer and drops those
    /// leaves; leaves the backward has not reached yet (the other half of a block run as two
    /// segments) keep theirs. Without `set_unit_casts` there are none.
    pub(crate) fn add_cast_grads(&self, layer_idx: Option<usize>) {
        if !self.unit_casts {
            return;
        }
        let n_layer = self.shape.n_layer;
        let slots = match layer_idx {
            Some(layer_idx) => layer_idx * Slot::PER_BLOCK..(layer_idx + 1) * Slot::PER_BLOCK,
            None => n_layer * Slot::PER_BLOCK..n_layer * Slot::PER_BLOCK + 1,
        };
        let mut leaves = self.leaves.borrow_mut();
        for slot in slots.clone() {
            let Some(leaf) = &leaves[slot] else { continue };
            let grad = leaf.grad();
            if !grad.defined() {
                continue;
            }
            tch::no_grad(|| {
                let mut master = self.param_of(Slot(slot)).grad();
                master += &grad;
            });
            leaves[slot] = None;
        }
        if let Some(layer_idx) = layer_idx {
            if !self.reuse_casts && leaves[slots].iter().all(Option::is_none) {
                self.block_casts.borrow_mut()[layer_idx] = None;
            }
        }
    }

    /// `add_cast_grads` for every block and the head.
    pub(crate) fn add_all_cast_grads(&self) {
        for layer_idx in 0..self.shape.n_layer {
            self.add_cast_grads(Some(layer_idx));
        }
        self.add_cast_grads(None);
    }

    /// The fp32 parameter behind `slot` (the leaf view of the flat buffer whose `.grad` is a view
    /// of the flat gradient).
    pub(super) fn param_of(&self, slot: Slot) -> &Tensor {
        match slot.layer(self.shape.n_layer) {
            Some(layer_idx) => &self.block_entry(layer_idx, slot).1.tensor,
            None => &self.wte,
        }
    }

    /// Block `layer_idx`'s unit and the entry of its parameter in `slot`.
    pub(super) fn block_entry(&self, layer_idx: usize, slot: Slot) -> (&UnitRange, &ParamEntry) {
        let unit = &self.params.units()[layer_idx + 1];
        (unit, &self.params.entries()[unit.entries.start + slot.param_in_block()])
    }

    /// The 16-bit leaf of `slot` for a forward with autograd (see `set_unit_casts`): the one
    /// handed out since the last `add_cast_grads` of its block, or a new one, cut from the block's
    /// one cast (made now if the step has none yet). The head's is its own cast of the embedding.
    pub(super) fn leaf(&self, slot: Slot) -> Tensor {
        if let Some(leaf) = &self.leaves.borrow()[slot.0] {
            return leaf.shallow_clone();
        }
        let values = match slot.layer(self.shape.n_layer) {
            None => tch::no_grad(|| self.wte.to_kind(self.compute)),
            Some(layer_idx) => self.block_cast_of(layer_idx, slot),
        };
        let leaf = values.detach().set_requires_grad(true);
        self.leaves.borrow_mut()[slot.0] = Some(leaf.shallow_clone());
        leaf
    }

    /// Slot `slot`'s part of block `layer_idx`'s one cast (made now if the step has none yet).
    pub(super) fn block_cast_of(&self, layer_idx: usize, slot: Slot) -> Tensor {
        let (unit, entry) = self.block_entry(layer_idx, slot);
        let cast = self.block_casts.borrow_mut()[layer_idx]
            .get_or_insert_with(|| {
                let len = unit.range.end - unit.range.start;
                tch::no_grad(|| self.params.flat().narrow(0, unit.range.start, len).to_kind(self.compute))
            })
            .shallow_clone();
        cast.narrow(0, entry.offset - unit.range.start, entry.numel).view(entry.shape.as_slice())
    }

    /// How many casts the step keeps now (each weight and bias of the linear layers once reuse
    /// is on and a micro-batch ran with autograd).
    pub fn kept_casts(&self) -> usize {
        self.casts.borrow().iter().filter(|cast| cast.is_some()).count()
    }

    /// `tensor` in the compute type: the step's kept cast if there is one; a new one otherwise,
    /// kept when reuse is on and it is part of the autograd graph (a cast made under `no_grad`,
    /// an evaluation or a recomputed forward, has no path to the master's gradient).
    pub(super) fn cast(&self, slot: Slot, tensor: &Tensor) -> Tensor {
        if let Some(cast) = &self.casts.borrow()[slot.0] {
            return cast.shallow_clone();
        }
        let cast = tensor.to_kind(self.compute);
        if self.reuse_casts && cast.requires_grad() {
            self.casts.borrow_mut()[slot.0] = Some(cast.shallow_clone());
        }
        cast
    }

    /// Linear layer `layer` (a `Slot` constant) of block `layer_idx` on `x` in the compute type,
    /// outside the graph, from its fp32 weight and bias `master`: the output and the weight as
    /// cast (`weight16`), which the layer's backward by hand takes.
    pub(super) fn linear16(
        &self,
        x: &Tensor,
        layer_idx: usize,
        layer: usize,
        master: (&Tensor, &Tensor),
    ) -> (Tensor, Tensor) {
        let slot = Slot::weight(layer_idx, layer);
        let weight = self.weight16(layer_idx, slot, master.0);
        let out = tch::no_grad(|| x.linear(&weight, Some(&self.weight16(layer_idx, slot.bias(), master.1))));
        (out, weight)
    }

    /// Slot `slot`'s weight or bias (`master`, fp32) in the compute type, outside the graph: its
    /// part of the block's one cast with unit casts, else a cast of its own.
    pub(super) fn weight16(&self, layer_idx: usize, slot: Slot, master: &Tensor) -> Tensor {
        if self.unit_casts {
            self.block_cast_of(layer_idx, slot)
        } else {
            tch::no_grad(|| master.to_kind(self.compute))
        }
    }
}
