//! Held-out evaluation and early stopping.

use stoke_data::BatchSource;

use crate::config::EvalConfig;
use crate::executor::StepHooks;
use crate::TrainError;

use super::events::EvalRecord;
use super::state::{EvalState, Trainer};

impl Trainer {
    /// Evaluates on `source` (the held-out split) every `config.every` steps and after the last,
    /// with early stopping. Each evaluation reads the same `config.batches` micro-batches from
    /// the source's start.
    pub fn set_eval(&mut self, config: &EvalConfig, source: Box<dyn BatchSource>) -> Result<(), TrainError> {
        config.validate()?;
        let (best, best_step, stale) =
            self.eval.as_ref().map_or((f64::INFINITY, None, 0), |e| (e.best, e.best_step, e.stale));
        self.eval = Some(EvalState { config: config.clone(), source, best, best_step, stale });
        Ok(())
    }

    /// The best evaluation's step, for retention to keep (None before any, or without
    /// `eval.keep_best`).
    pub fn best_eval_step(&self) -> Option<u64> {
        self.eval.as_ref().filter(|e| e.config.keep_best).and_then(|e| e.best_step)
    }

    pub(super) fn eval_keeps_best(&self) -> bool {
        self.eval.as_ref().is_some_and(|e| e.config.keep_best)
    }

    /// The mean loss over the evaluation batches (averaged over the ranks), no gradients.
    pub(super) fn evaluate(&mut self, hooks: &mut dyn StepHooks) -> Result<(f64, u64), TrainError> {
        if self.eval.is_none() {
            return Ok((f64::NAN, 0));
        }
        hooks.full_parameters(true)?;
        let Some(eval) = self.eval.as_mut() else { return Ok((f64::NAN, 0)) };
        let shape = self.model.shape();
        eval.source.seek(0);
        let (mut sum, mut tokens) = (0.0, 0u64);
        for _ in 0..eval.config.batches {
            let batch = eval.source.next_batch()?;
            let rows = batch.micro_batch;
            let inputs = super::inputs::inputs_of(
                &batch,
                shape,
                self.episode_shape.as_ref(),
                self.train.micro_batch,
                self.step,
                self.device,
            )?;
            eval.source.recycle(batch);
            let loss = tch::no_grad(|| self.model.eval_loss(&inputs)).double_value(&[]);
            sum += loss;
            tokens += (rows * shape.seq_len) as u64;
        }
        hooks.full_parameters(false)?;
        let loss = hooks.reduce_loss(sum / eval.config.batches as f64)?;
        Ok((loss, tokens))
    }

    /// Whether step `step` (1-based) ends with an evaluation.
    pub(super) fn eval_due(&self, step: u64) -> bool {
        match &self.eval {
            Some(e) => e.config.every > 0 && (step % e.config.every == 0 || step == self.train.steps),
            None => false,
        }
    }

    /// Evaluates when `step` is due; updates the best loss and early stopping.
    pub(super) fn maybe_evaluate(
        &mut self,
        step: u64,
        hooks: &mut dyn StepHooks,
    ) -> Result<Option<EvalRecord>, TrainError> {
        if !self.eval_due(step) {
            return Ok(None);
        }
        let (loss, tokens) = self.evaluate(hooks)?;
        let eval = self.eval.as_mut().expect("due implies set");
        let improved = loss < eval.best - eval.config.min_delta;
        if improved {
            eval.stale = 0;
        } else {
            eval.stale += 1;
        }
        if loss < eval.best {
            eval.best = loss;
            eval.best_step = Some(step);
        }
        let stop = eval.config.patience > 0 && eval.stale >= eval.config.patience && step < self.train.steps;
        let best = eval.best_step == Some(step);
        Ok(Some(EvalRecord { loss, perplexity: loss.exp(), tokens, best, stop }))
    }
}
