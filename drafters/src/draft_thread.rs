//! A draft model on a thread of its own, drafting ahead while the target verifies.
//!
//! On a GPU, decoding models of this size is bound by host time: building graphs and
//! queueing them in MLX while the GPU mostly waits (docs/benchmarks.md, "Where the time
//! goes on CUDA"). On the engine's thread a draft model's steps and the target's verify
//! add up. Here they overlap: MLX (0.31.2 on) evaluates
//! independent graphs from several threads, each thread on its own default stream.
//!
//! While the target verifies a round, this thread keeps drafting as though every draft
//! will be kept and the target's own next token will be the draft model's guess. When
//! that comes true (a fully kept round, common with a good draft model), the next
//! round's drafts are ready or nearly. When it does not, the cache is trimmed back to
//! what the target committed and drafting restarts there, as it would have anyway. The
//! drafts themselves are always the draft model's greedy tokens after the committed
//! sequence, so what is drafted never depends on timing.
//!
//! Everything MLX of the draft model lives on this thread: MLX streams belong to the
//! thread that made them, and an unevaluated array from another thread cannot be
//! evaluated here. The model is loaded on the caller's thread and evaluated once through
//! a whole forward ([`DraftThread::spawn`] does it) before it moves.

use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use mlx_rs::ops::indexing::{argmax_axis, TryIndexOp};
use mlx_rs::ops::{concatenate, eq, sum};
use mlx_rs::{Array, Dtype};

use dspec_adapters::attention::{whole_buffer_pays, WHOLE_BUFFER_MAX_TOKENS};
use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{Agreement, DraftAhead, ModelCache, TargetModel};

/// How long dropping a [`DraftThread`] waits for the thread to end. It ends within its
/// current step, so this is only reached when that step never returns: after a failure
/// on the device (a CUDA error is sticky: the context's later work never completes, and
/// MLX waits on it), where the caller's error must still reach the user.
const END_WAIT: Duration = Duration::from_secs(10);

/// Longest prompt slice fed to the draft model in one forward while starting.
const PREFILL_CHUNK: usize = 512;

/// Most tokens fed one step each rather than in one forward (the target's correction
/// after a rejected draft, or that plus one). On a GPU a one-token step is the cheap
/// kind: rounds that began with a 2-token forward spent longer drafting than rounds of
/// one-token steps only (docs/benchmarks.md, "Drafting ahead").
const ONE_BY_ONE: usize = 2;

/// Drafting ahead pays only when it often comes true: a round that comes true saves
/// more than one that does not loses (the step in flight, and the drafted-ahead work
/// queued on the GPU), and the two break even at the share of rounds given in
/// docs/benchmarks.md, "Drafting ahead". A round comes true only when it kept every
/// draft (and the guess was right), so drafting ahead pauses while fewer than this share
/// of recent rounds kept every draft: a margin above break-even, chosen, not measured.
const KEPT_ALL_TO_LOOK_AHEAD: f64 = 0.4;

/// Weight of the newest round in that share (an exponential moving average).
const KEPT_ALL_WEIGHT: f64 = 0.2;

/// How far back the draft model's cache must be able to go after any forward, when it
/// has recurrent layers: a round's drafts and what was drafted ahead of them (ahead is
/// capped to it), for rounds of up to `--max-draft auto`'s 8 drafts. Longer rounds that
/// reject early read the sequence again instead (see `Chain::restart_at`).
const ROLLBACK_WINDOW: usize = 16;

/// What the engine's thread asks of the draft thread. Every request gets one reply.
///
/// Requests that grow the committed sequence say from which of the new tokens on
/// (`check_from`) the model's guesses are checked ([`DraftThread::agreement`]): the
/// tokens of plain decoding steps, not the ones a drafting round already accounted for.
enum Request {
    /// A new sequence: forget everything and read this prompt.
    Begin(Vec<u32>),
    /// The committed sequence grew by these tokens while the engine decodes without
    /// drafts: read them now, so that the next round's drafting finds them read.
    Feed {
        committed: Vec<u32>,
        check_from: usize,
    },
    /// The committed sequence grew by `committed`: the model's `k` greedy tokens after it.
    Draft {
        committed: Vec<u32>,
        check_from: usize,
        k: usize,
    },
    /// The committed sequence grew by `committed`: the model's logits after it followed
    /// by `extra` (sampled drafting, where the engine picks each token).
    Logits {
        committed: Vec<u32>,
        check_from: usize,
        extra: Vec<u32>,
    },
    /// Reply once drafting ahead has gone as far as it goes (tests).
    #[cfg(test)]
    Settle,
}

enum Reply {
    Begun,
    Fed,
    Tokens(Drafted),
    Logits(Vec<f32>),
    /// With the positions the latest `begin` found already read.
    #[cfg(test)]
    Settled(usize),
}

/// A round's drafts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drafted {
    pub tokens: Vec<u32>,
    /// How many of them had been drafted ahead before the round asked for them.
    pub ready: usize,
}

/// The engine's handle on the draft thread.
pub struct DraftThread {
    requests: Option<Sender<Request>>,
    replies: Receiver<Result<Reply>>,
    /// Replies not yet collected (a `begin` does not wait for its own).
    outstanding: usize,
    handle: Option<JoinHandle<()>>,
    /// Disconnected when the thread has ended (its sender dropped last).
    ended: Receiver<()>,
    /// The model's guesses checked against committed tokens, added up by the thread.
    agreement: Arc<Mutex<Agreement>>,
}

/// Evaluates a forward of `model` on a throwaway cache, so that every array the model
/// derived while loading (fused projections, casts, quantized weights) is computed on
/// the caller's thread and the model (or a share of it) can move to another.
pub(crate) fn warm_up(model: &dyn TargetModel) -> Result<()> {
    let mut cache = model.new_cache();
    let out = model.forward(&Array::from_slice(&[0u32], &[1, 1]), &mut cache, &[])?;
    out.logits.eval()?;
    Ok(())
}

impl DraftThread {
    /// Moves `model`, loaded on this thread, onto its own. `vocab`: logits are cut to
    /// this many entries. `ahead`: whether to draft past what was asked while idle.
    /// `max_new_tokens`: what a generation may add after its prompt, when known.
    pub fn spawn(
        model: Box<dyn TargetModel>,
        vocab: usize,
        ahead: DraftAhead,
        max_new_tokens: Option<usize>,
    ) -> Result<Self> {
        warm_up(model.as_ref())?;
        Self::spawn_warm(model, vocab, ahead, max_new_tokens)
    }

    /// [`DraftThread::spawn`] of a model whose arrays are all evaluated already: one
    /// [`warm_up`] evaluated on this thread, or a share of one taken after it.
    pub(crate) fn spawn_warm(
        model: Box<dyn TargetModel>,
        vocab: usize,
        ahead: DraftAhead,
        max_new_tokens: Option<usize>,
    ) -> Result<Self> {
        let (requests, inbox) = channel();
        let (outbox, replies) = channel();
        let vocab = vocab.min(model.info().vocab_size) as i32;
        let agreement = Arc::new(Mutex::new(Agreement::default()));
        let counted = Arc::clone(&agreement);
        let (ending, ended) = channel::<()>();
        let handle = std::thread::Builder::new()
            .name("dspec-draft".into())
            .spawn(move || {
                serve(
                    Chain::new(model, vocab, ahead, max_new_tokens, counted),
                    inbox,
                    outbox,
                );
                drop(ending);
            })
            .map_err(|e| {
                ModelError::Unsupported(format!("starting the draft model's thread: {e}"))
            })?;
        Ok(Self {
            requests: Some(requests),
            replies,
            outstanding: 0,
            handle: Some(handle),
            ended,
            agreement,
        })
    }

    /// Of the committed tokens read since the last call from `check_from` on, how many
    /// the model's greedy guess (from the tokens before each) matched. Counted as the
    /// thread reads them, so tokens still being read count at a later call.
    pub fn agreement(&self) -> Agreement {
        match self.agreement.lock() {
            Ok(mut counted) => std::mem::take(&mut *counted),
            // The thread panicked while counting: nothing trustworthy to report.
            Err(_) => Agreement::default(),
        }
    }

    fn send(&mut self, request: Request) -> Result<()> {
        let sent = self.requests.as_ref().map(|r| r.send(request).is_ok());
        if sent != Some(true) {
            return Err(stopped());
        }
        self.outstanding += 1;
        Ok(())
    }

    /// Waits for every outstanding reply; returns the last, or the first failure.
    fn collect(&mut self) -> Result<Reply> {
        let (mut last, mut failure) = (None, None);
        while self.outstanding > 0 {
            let reply = self.replies.recv().map_err(|_| stopped())?;
            self.outstanding -= 1;
            match reply {
                Ok(reply) => last = Some(reply),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        match failure {
            Some(e) => Err(e),
            None => last.ok_or_else(stopped),
        }
    }

    /// Starts a sequence; the reply is collected with the next request's.
    pub fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.send(Request::Begin(prompt.to_vec()))
    }

    /// Tells the thread that the committed sequence grew by `committed`, without waiting:
    /// it reads them while the engine goes on (the reply is collected with the next
    /// request's), so a long run of plain decoding steps is not read all at once when
    /// drafting resumes. Guesses are checked from `committed[check_from]` on.
    pub fn feed(&mut self, committed: Vec<u32>, check_from: usize) -> Result<()> {
        self.send(Request::Feed {
            committed,
            check_from,
        })
    }

    /// The draft model's `k` greedy tokens after the committed sequence, which has grown
    /// by `committed` since the last request (guesses checked from `check_from` on).
    pub fn draft(&mut self, committed: Vec<u32>, check_from: usize, k: usize) -> Result<Drafted> {
        self.send(Request::Draft {
            committed,
            check_from,
            k,
        })?;
        match self.collect()? {
            Reply::Tokens(drafted) => Ok(drafted),
            _ => Err(unexpected()),
        }
    }

    /// The draft model's logits (cut to the vocabulary) after the committed sequence,
    /// grown by `committed` (guesses checked from `check_from` on), followed by `extra`.
    pub fn logits(
        &mut self,
        committed: Vec<u32>,
        check_from: usize,
        extra: Vec<u32>,
    ) -> Result<Vec<f32>> {
        self.send(Request::Logits {
            committed,
            check_from,
            extra,
        })?;
        match self.collect()? {
            Reply::Logits(logits) => Ok(logits),
            _ => Err(unexpected()),
        }
    }

    /// Waits until drafting ahead stops; returns the positions the latest `begin`
    /// found already read.
    #[cfg(test)]
    fn settle(&mut self) -> Result<usize> {
        self.send(Request::Settle)?;
        match self.collect()? {
            Reply::Settled(kept) => Ok(kept),
            _ => Err(unexpected()),
        }
    }
}

impl Drop for DraftThread {
    fn drop(&mut self) {
        // Closing the channel ends the thread after its current step; waiting for it
        // frees the model's memory before this returns. A thread stuck past
        // `END_WAIT` is left behind rather than waited on forever.
        self.requests = None;
        if let Some(handle) = self.handle.take() {
            if self.ended.recv_timeout(END_WAIT) != Err(RecvTimeoutError::Timeout) {
                let _ = handle.join();
            }
        }
    }
}

fn stopped() -> ModelError {
    ModelError::Unsupported("the draft model's thread stopped unexpectedly".into())
}

fn unexpected() -> ModelError {
    ModelError::Unsupported("the draft model's thread answered out of turn".into())
}

/// The thread's loop: answer requests; between them, draft ahead.
fn serve(mut chain: Chain, inbox: Receiver<Request>, outbox: Sender<Result<Reply>>) {
    loop {
        let request = if chain.wants_more() {
            match inbox.try_recv() {
                Ok(request) => request,
                Err(TryRecvError::Empty) => {
                    chain.look_ahead();
                    continue;
                }
                Err(TryRecvError::Disconnected) => return,
            }
        } else {
            match inbox.recv() {
                Ok(request) => request,
                Err(_) => return,
            }
        };
        if outbox.send(chain.answer(request)).is_err() {
            return;
        }
    }
}

/// The sequence the draft model's cache stands for: what the engine committed (the
/// prompt, the tokens kept since, and the newest token), then the model's own greedy
/// continuation.
struct Chain {
    model: Box<dyn TargetModel>,
    cache: ModelCache,
    vocab: i32,
    /// The sequence's first tokens as ids...
    host: Vec<u32>,
    /// ...and the rest, the model's argmax tokens still on the device (`[1]` each).
    lazy: Vec<Array>,
    /// Positions the cache holds: the sequence's first `fed` tokens. The sequence is
    /// `fed` long, or one longer when the argmax after them is known.
    fed: usize,
    /// Every token from here on is the model's own argmax after the ones before it.
    own_from: usize,
    /// How many tokens the engine has committed (the sequence's prefix it vouches for);
    /// `None` before the first `begin` and after a failure.
    committed: Option<usize>,
    /// Draft ahead, while idle, until the sequence is this long.
    ahead_until: usize,
    ahead: DraftAhead,
    /// The last round's drafts, and the recent share of rounds that kept all of them.
    last_drafts: Vec<u32>,
    kept_all: f64,
    /// A failure while drafting ahead, reported with the next request.
    failed: Option<ModelError>,
    /// Positions a generation may add after its prompt, when known.
    max_new_tokens: Option<usize>,
    /// Positions of the committed sequence whose guesses are checked when read, the
    /// checks still on the device (matches, positions), and where they are added up.
    checking: Range<usize>,
    pending_checks: Vec<(Array, usize)>,
    agreement: Arc<Mutex<Agreement>>,
    #[cfg(test)]
    kept_at_begin: usize,
}

impl Chain {
    fn new(
        model: Box<dyn TargetModel>,
        vocab: i32,
        ahead: DraftAhead,
        max_new_tokens: Option<usize>,
        agreement: Arc<Mutex<Agreement>>,
    ) -> Self {
        let mut cache = model.new_cache();
        cache.set_rollback_window(ROLLBACK_WINDOW);
        Self {
            model,
            cache,
            vocab,
            host: Vec::new(),
            lazy: Vec::new(),
            fed: 0,
            own_from: 0,
            committed: None,
            ahead_until: 0,
            ahead,
            last_drafts: Vec::new(),
            kept_all: 1.0,
            failed: None,
            max_new_tokens,
            checking: 0..0,
            pending_checks: Vec::new(),
            agreement,
            #[cfg(test)]
            kept_at_begin: 0,
        }
    }

    fn len(&self) -> usize {
        self.host.len() + self.lazy.len()
    }

    fn wants_more(&self) -> bool {
        self.failed.is_none() && self.len() < self.ahead_until
    }

    fn look_ahead(&mut self) {
        if let Err(e) = self.extend() {
            self.failed = Some(e);
        }
    }

    fn answer(&mut self, request: Request) -> Result<Reply> {
        let reply = match (request, self.failed.take()) {
            // A new sequence needs nothing from the old one.
            (Request::Begin(prompt), _) => self.begin(prompt).map(|()| Reply::Begun),
            (_, Some(e)) => Err(e),
            (
                Request::Feed {
                    committed,
                    check_from,
                },
                None,
            ) => self.feed(&committed, check_from).map(|()| Reply::Fed),
            (
                Request::Draft {
                    committed,
                    check_from,
                    k,
                },
                None,
            ) => self.draft(&committed, check_from, k).map(Reply::Tokens),
            (
                Request::Logits {
                    committed,
                    check_from,
                    extra,
                },
                None,
            ) => self
                .logits(&committed, check_from, &extra)
                .map(Reply::Logits),
            #[cfg(test)]
            (Request::Settle, None) => {
                while self.wants_more() {
                    self.extend()?;
                }
                Ok(Reply::Settled(self.kept_at_begin))
            }
        };
        if reply.is_err() {
            // The cache may be half-updated: nothing more until the next `begin`.
            self.committed = None;
            self.ahead_until = 0;
        }
        reply
    }

    /// The model's `k` greedy tokens after the committed sequence grown by `committed`
    /// (fewer when eager and some were ready), then drafting ahead is armed.
    fn draft(&mut self, committed: &[u32], check_from: usize, k: usize) -> Result<Drafted> {
        self.observe_round(committed);
        let want = self.committed_with(committed, check_from)?;
        let ready = match self.follow(&want)? {
            true => (self.len() - want.len()).min(k),
            false => 0,
        };
        let taken = match self.ahead {
            DraftAhead::Eager if ready > 0 => ready,
            _ => k,
        };
        while self.len() < want.len() + taken {
            self.extend()?;
        }
        self.resolve()?;
        let tokens = self.host[want.len()..want.len() + taken].to_vec();
        // Ahead: this round's drafts, the guess of the target's next token, and `k`
        // drafts for the next round.
        if self.ahead != DraftAhead::Off && self.kept_all >= KEPT_ALL_TO_LOOK_AHEAD {
            self.ahead_until = want.len() + taken + 1 + k;
            // Not further than the cache can roll back to the committed sequence.
            if let Some(window) = self.cache.rollback_window() {
                self.ahead_until = self.ahead_until.min(want.len() + window);
            }
        }
        self.last_drafts = tokens.clone();
        Ok(Drafted { tokens, ready })
    }

    /// Grows the committed sequence by `committed` and reads all of it but its last
    /// token, which the next round feeds anyway to get the logits after it.
    fn feed(&mut self, committed: &[u32], check_from: usize) -> Result<()> {
        let want = self.committed_with(committed, check_from)?;
        if want.len() < 2 {
            return Ok(());
        }
        let keep = self.keep_for(&want);
        self.fed = self.rewind_to(keep, want.len())?;
        let keep = self.fed;
        let piece = match keep {
            // Read again from the start: a prompt's reading.
            0 => PREFILL_CHUNK,
            _ => WHOLE_BUFFER_MAX_TOKENS as usize,
        };
        for piece in want[keep..want.len() - 1].chunks(piece) {
            // The cache is wanted, and the logits only where guesses are checked.
            self.read(piece, self.fed, &want)?;
            self.fed += piece.len();
        }
        mlx_rs::transforms::eval(self.cache.state())?;
        self.count_checks()?;
        self.own_from = want.len();
        self.host = want;
        Ok(())
    }

    /// Feeds `tokens`, the positions of `sequence` from `start` on, and returns the logits
    /// after each (`[n, vocab]`). Each row is the model's guess of the next position:
    /// where that position is one being checked, whether the guess matched is counted
    /// (on the device; read by [`Self::count_checks`]).
    fn read(&mut self, tokens: &[u32], start: usize, sequence: &[u32]) -> Result<Array> {
        let n = tokens.len();
        let out = self
            .model
            .forward(&self.input(tokens), &mut self.cache, &[])?;
        let logits = out.logits.try_index((0, .., ..self.vocab))?;
        let first = self.checking.start.max(start + 1);
        let end = self.checking.end.min(start + n + 1).min(sequence.len());
        if first < end {
            let rows = (first - start - 1) as i32..(end - start - 1) as i32;
            let guesses = argmax_axis(logits.try_index(rows)?, -1, false)?;
            let actual = Array::from_slice(&sequence[first..end], &[(end - first) as i32]);
            let matches = sum(eq(guesses.as_dtype(Dtype::Uint32)?, actual)?, None)?;
            mlx_rs::transforms::async_eval([&matches])?;
            self.pending_checks.push((matches, end - first));
        }
        Ok(logits)
    }

    /// Adds the checks made so far to what [`DraftThread::agreement`] reports.
    fn count_checks(&mut self) -> Result<()> {
        if self.pending_checks.is_empty() {
            return Ok(());
        }
        let mut counted = Agreement::default();
        for (matches, checked) in std::mem::take(&mut self.pending_checks) {
            let agreed = matches.try_item_cast::<u32>().map_err(|e| {
                ModelError::Unsupported(format!("reading the draft model's checks: {e}"))
            })?;
            counted.add(Agreement {
                agreed: agreed as usize,
                checked,
            });
        }
        if let Ok(mut total) = self.agreement.lock() {
            total.add(counted);
        }
        Ok(())
    }

    /// How many of the cached positions `want` can keep: those it shares with the
    /// sequence, short of its last token, whose logits are always computed afresh.
    fn keep_for(&self, want: &[u32]) -> usize {
        common_prefix(&self.host, want)
            .min(self.fed)
            .min(want.len().saturating_sub(1))
    }

    /// Moves the cache back to its first `keep` positions for a sequence of `len`
    /// tokens, and returns how many it kept: none when a model with recurrent state
    /// cannot go back that far (drafting ahead is capped to stay within its window; a
    /// round longer than the window is not), which then reads the sequence again.
    fn rewind_to(&mut self, keep: usize, len: usize) -> Result<usize> {
        if self.fed - keep > self.cache.rollback_limit() {
            self.cache = self.model.new_cache();
            self.cache.set_rollback_window(ROLLBACK_WINDOW);
            if let Some(room) = self.max_new_tokens {
                self.cache.reserve_for_generation(len + room);
            }
            return Ok(0);
        }
        self.cache.trim(self.fed - keep)?;
        Ok(keep)
    }

    /// The model's logits after the committed sequence grown by `committed`, followed
    /// by `extra`, on the host.
    fn logits(&mut self, committed: &[u32], check_from: usize, extra: &[u32]) -> Result<Vec<f32>> {
        let mut want = self.committed_with(committed, check_from)?;
        want.extend_from_slice(extra);
        let logits = self.restart_at(&want)?.as_dtype(Dtype::Float32)?;
        logits.eval()?;
        Ok(logits.as_slice::<f32>().to_vec())
    }

    /// Updates the share of rounds that kept every draft: `committed` holds the last
    /// round's kept drafts and the target's token.
    fn observe_round(&mut self, committed: &[u32]) {
        if self.last_drafts.is_empty() {
            return;
        }
        let n = self.last_drafts.len();
        let kept_all = committed.len() == n + 1 && committed[..n] == self.last_drafts[..];
        let now = if kept_all { 1.0 } else { 0.0 };
        self.kept_all += KEPT_ALL_WEIGHT * (now - self.kept_all);
    }

    fn begin(&mut self, prompt: Vec<u32>) -> Result<()> {
        // The sequence before may share a prefix with this one (a server's next request:
        // a chat's next turn): its positions are kept, not read again. After a failure
        // the cache may be half-updated, and is read afresh.
        let readable = self.committed.is_some() && self.resolve().is_ok();
        let shared = match readable {
            true => common_prefix(&self.host, &prompt).min(self.fed),
            false => 0,
        };
        self.committed = None;
        self.last_drafts.clear();
        self.lazy.clear();
        self.checking = 0..0;
        self.pending_checks.clear();
        let kept = match shared {
            0 => 0,
            _ => self.rewind_to(shared, prompt.len())?,
        };
        #[cfg(test)]
        {
            self.kept_at_begin = kept;
        }
        if kept == 0 {
            self.cache = self.model.new_cache();
            self.cache.set_rollback_window(ROLLBACK_WINDOW);
        }
        if let Some(room) = self.max_new_tokens {
            self.cache.reserve_for_generation(prompt.len() + room);
        }
        // After a kept prefix the rest is a continuation over the cache: read in pieces
        // that attend over the whole buffer, as catching up does, where a forward of its
        // own length would build an attention plan of its own first (on CUDA, in the way
        // of the first round's drafts).
        let piece = match kept {
            0 => PREFILL_CHUNK,
            _ if whole_buffer_pays() => WHOLE_BUFFER_MAX_TOKENS as usize,
            _ => PREFILL_CHUNK,
        };
        for chunk in prompt[kept..].chunks(piece) {
            // Only the cache is wanted: the logits stay unevaluated.
            self.model
                .forward(&self.input(chunk), &mut self.cache, &[])?;
            mlx_rs::transforms::eval(self.cache.state())?;
        }
        if kept == 0 && whole_buffer_pays() {
            // A continuation over the whole buffer has an attention plan of its own to
            // build the first time (docs/benchmarks.md, "Where the time goes on CUDA"):
            // built now, while the target reads the prompt, not at the first catch-up.
            // Two throwaway positions, trimmed again.
            if let Some(&last) = prompt.last() {
                let out = self
                    .model
                    .forward(&self.input(&[last, last]), &mut self.cache, &[])?;
                out.logits.eval()?;
                self.cache.trim(2)?;
            }
        }
        self.fed = prompt.len();
        self.own_from = prompt.len();
        self.committed = Some(prompt.len());
        self.ahead_until = 0;
        self.host = prompt;
        Ok(())
    }

    /// The committed sequence after appending `committed`, whose tokens from
    /// `check_from` on have their guesses checked when read.
    fn committed_with(&mut self, committed: &[u32], check_from: usize) -> Result<Vec<u32>> {
        self.resolve()?;
        let Some(known) = self.committed.filter(|&n| n <= self.host.len()) else {
            return Err(ModelError::Unsupported(
                "the draft model has no prompt to draft after (begin failed or was not called)"
                    .into(),
            ));
        };
        let mut want = self.host[..known].to_vec();
        want.extend_from_slice(committed);
        self.checking = known + check_from.min(committed.len())..want.len();
        self.committed = Some(want.len());
        self.ahead_until = 0;
        Ok(want)
    }

    /// Makes the sequence `want` followed by the model's own greedy continuation:
    /// kept as it is (true) when it already is that (the drafting ahead came true).
    fn follow(&mut self, want: &[u32]) -> Result<bool> {
        self.resolve()?;
        let shared = common_prefix(&self.host, want);
        if shared == want.len() && self.own_from <= want.len() {
            return Ok(true);
        }
        self.restart_at(want).map(|_| false)
    }

    /// Makes the sequence exactly `want` plus the argmax after it, keeping the cache
    /// entries it shares with `want`; returns the logits after `want`.
    fn restart_at(&mut self, want: &[u32]) -> Result<Array> {
        if want.is_empty() {
            return Err(ModelError::Unsupported(
                "the draft model was asked to continue an empty sequence".into(),
            ));
        }
        self.resolve()?;
        // At least the last token is fed again: its logits are what is asked for.
        let keep = self.keep_for(want);
        let keep = self.rewind_to(keep, want.len())?;
        self.fed = keep;
        self.host = want.to_vec();
        self.own_from = want.len();
        let rest = &want[keep..];
        // A short remainder goes one token a step (the cheap kind on a GPU); a longer
        // one in pieces no longer than a continuation over the whole cache buffer, which
        // the model pads to one width: on CUDA a forward of any other shape after the
        // cache builds a cuDNN graph for it, and catching up after a run of plain steps
        // comes in every length. Only the last piece's logits are used.
        let piece = match rest.len() {
            // Read again from the start: a prompt's reading.
            _ if keep == 0 => PREFILL_CHUNK,
            0..=ONE_BY_ONE => 1,
            _ => WHOLE_BUFFER_MAX_TOKENS as usize,
        };
        let mut logits = None;
        let mut start = keep;
        for piece in rest.chunks(piece) {
            let all = self.read(piece, start, want)?;
            logits = Some(all.try_index(-1..)?);
            start += piece.len();
        }
        let logits = logits.ok_or_else(|| ModelError::Unsupported("nothing to feed".into()))?;
        self.fed = want.len();
        self.push_argmax(&logits)?;
        Ok(logits)
    }

    /// Feeds the sequence's last token and appends the model's argmax after it.
    fn extend(&mut self) -> Result<()> {
        if self.len() == self.fed {
            // The argmax after the sequence is not known (just after `begin`): feed the
            // last token again.
            if self.fed == 0 {
                return Err(ModelError::Unsupported(
                    "the draft model was asked to continue an empty sequence".into(),
                ));
            }
            self.cache.trim(1)?;
            self.fed -= 1;
        }
        let last = match self.lazy.last() {
            Some(id) => id.reshape(&[1, 1])?,
            None => self.input(&self.host[self.host.len() - 1..]),
        };
        let logits = self.step(&last)?;
        self.fed += 1;
        self.push_argmax(&logits)
    }

    /// `tokens` as the model's input, `[1, n]`. The target may commit ids the draft model
    /// has no embedding row for (its vocabulary is padded further: Qwen2.5-7B's has 128
    /// rows more than Qwen2.5-0.5B's, ids no tokenizer produces and trained weights
    /// never pick, but random ones do). Looking one up would read past the embedding
    /// (on CUDA, an illegal memory access that ends the process), so each is read as the
    /// model's last row: what follows is drafted from a token that stands in for it, and
    /// the target verifies those drafts like any others.
    fn input(&self, tokens: &[u32]) -> Array {
        let last_row = (self.model.info().vocab_size as u32).saturating_sub(1);
        let ids: Vec<u32> = tokens.iter().map(|&id| id.min(last_row)).collect();
        Array::from_slice(&ids, &[1, ids.len() as i32])
    }

    /// The model's last-position logits for `tokens` fed after the cache, `[1, V]`.
    fn step(&mut self, tokens: &Array) -> Result<Array> {
        let out = self.model.forward(tokens, &mut self.cache, &[])?;
        Ok(out.logits.try_index((0, -1.., ..self.vocab))?)
    }

    /// Appends the argmax of `logits`, started on the device now and read when needed.
    fn push_argmax(&mut self, logits: &Array) -> Result<()> {
        let id = argmax_axis(logits, -1, false)?.as_dtype(Dtype::Uint32)?;
        mlx_rs::transforms::async_eval([&id])?;
        self.lazy.push(id);
        Ok(())
    }

    /// Reads the tokens still on the device (one wait for all of them).
    fn resolve(&mut self) -> Result<()> {
        self.count_checks()?;
        if self.lazy.is_empty() {
            return Ok(());
        }
        let ids = concatenate(&std::mem::take(&mut self.lazy), 0)?;
        ids.eval()?;
        let ids = ids
            .try_as_slice::<u32>()
            .map_err(|e| ModelError::Unsupported(format!("reading drafted ids: {e}")))?;
        self.host.extend_from_slice(ids);
        Ok(())
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspec_adapters::fixtures::{load_dir, write_random_model, TINY_LLAMA};
    use dspec_plugin_api::LoadOptions;

    const PROMPT: [u32; 5] = [3, 14, 15, 92, 65];

    /// A tiny random llama checkpoint (vocabulary 97).
    fn model_dir(seed: u64) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        write_random_model(dir.path(), TINY_LLAMA, seed, None).expect("fixture");
        dir
    }

    fn spawn_unstarted(dir: &tempfile::TempDir, ahead: DraftAhead) -> DraftThread {
        let model = load_dir(dir.path(), &LoadOptions::default()).expect("load");
        DraftThread::spawn(model, 97, ahead, None).expect("spawn")
    }

    /// A thread that has read [`PROMPT`].
    fn spawn(dir: &tempfile::TempDir, ahead: DraftAhead) -> DraftThread {
        let mut thread = spawn_unstarted(dir, ahead);
        thread.begin(&PROMPT).expect("begin");
        thread
    }

    /// The model's `k` greedy tokens after the prompt and 35, from a thread of its own.
    fn greedy_chain(dir: &tempfile::TempDir, k: usize) -> Vec<u32> {
        spawn(dir, DraftAhead::Off)
            .draft(vec![35], 0, k)
            .expect("chain")
            .tokens
    }

    fn argmax(logits: &[f32]) -> u32 {
        let best = logits
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
        best.0 as u32
    }

    /// A long catch-up (a run of plain steps committed at once) goes in pieces: the
    /// drafts after it are the ones a thread that read the whole sequence as its prompt
    /// makes.
    /// A server's next request (a chat's next turn) starts where the sequence before left
    /// off: the shared prefix stays read, drafting ahead included, and the drafts are
    /// those of a thread that read the new prompt from scratch.
    #[test]
    fn a_new_prompt_keeps_what_it_shares_with_the_sequence_before() {
        let dir = model_dir(29);
        let mut reused = spawn(&dir, DraftAhead::Eager);
        let first = reused.draft(vec![35], 0, 3).expect("a round").tokens;
        reused.settle().expect("ahead");
        let mut next = PROMPT.to_vec();
        next.push(35);
        next.extend_from_slice(&first[..2]);
        next.extend_from_slice(&[11, 12]);
        reused.begin(&next).expect("begin again");
        assert_eq!(reused.settle().expect("kept"), PROMPT.len() + 3);
        let drafts = reused.draft(vec![40], 0, 4).expect("reused").tokens;

        let mut fresh = spawn_unstarted(&dir, DraftAhead::Off);
        fresh.begin(&next).expect("begin");
        assert_eq!(fresh.settle().expect("kept"), 0);
        assert_eq!(drafts, fresh.draft(vec![40], 0, 4).expect("fresh").tokens);

        // A prompt sharing nothing reads everything.
        reused.begin(&[7, 8, 9]).expect("begin a third time");
        assert_eq!(reused.settle().expect("kept"), 0);
    }

    #[test]
    fn a_long_catch_up_drafts_what_reading_it_whole_does() {
        let dir = model_dir(23);
        let committed: Vec<u32> = (0..75).map(|i| (i * 29 + 7) % 97).collect();
        let mut caught_up = spawn(&dir, DraftAhead::Off);
        caught_up.draft(vec![35], 0, 2).expect("a first round");
        let drafts = caught_up
            .draft(committed.clone(), 0, 4)
            .expect("after the run")
            .tokens;

        let mut whole = spawn_unstarted(&dir, DraftAhead::Off);
        let mut prompt = PROMPT.to_vec();
        prompt.push(35);
        prompt.extend_from_slice(&committed[..committed.len() - 1]);
        whole.begin(&prompt).expect("begin");
        let expected = whole
            .draft(vec![committed[committed.len() - 1]], 0, 4)
            .expect("whole")
            .tokens;
        assert_eq!(drafts, expected);
    }

    /// A run of plain steps fed in pieces while it goes on (then the rest with the next
    /// round) drafts what reading the whole sequence as its prompt does, also when a
    /// piece rewinds what the thread had drafted after the last round.
    #[test]
    fn pieces_fed_in_the_background_draft_what_reading_it_whole_does() {
        let dir = model_dir(29);
        let committed: Vec<u32> = (0..81).map(|i| (i * 31 + 5) % 97).collect();
        let mut fed = spawn(&dir, DraftAhead::On);
        fed.draft(vec![35], 0, 3).expect("a first round");
        fed.feed(committed[..32].to_vec(), 0).expect("a piece");
        fed.feed(committed[32..33].to_vec(), 0)
            .expect("a one-token piece");
        fed.feed(committed[33..70].to_vec(), 0)
            .expect("a longer piece");
        let drafts = fed
            .draft(committed[70..].to_vec(), 0, 4)
            .expect("after the run")
            .tokens;

        let mut whole = spawn_unstarted(&dir, DraftAhead::Off);
        let mut prompt = PROMPT.to_vec();
        prompt.push(35);
        prompt.extend_from_slice(&committed[..committed.len() - 1]);
        whole.begin(&prompt).expect("begin");
        let expected = whole
            .draft(vec![committed[committed.len() - 1]], 0, 4)
            .expect("whole")
            .tokens;
        assert_eq!(drafts, expected);
    }

    /// Ids the target commits that the draft model has no embedding row for (a target
    /// vocabulary padded further) are read as the model's last row, in a prompt, a piece
    /// fed in the background and a round alike: the drafts are those after that row's id.
    #[test]
    fn ids_past_the_draft_vocabulary_read_as_its_last_row() {
        let dir = model_dir(37);
        let last = 96;
        let model = load_dir(dir.path(), &LoadOptions::default()).expect("load");
        // The target's vocabulary has 128 ids more than the draft model's 97.
        let mut wide = DraftThread::spawn(model, 97 + 128, DraftAhead::On, None).expect("spawn");
        wide.begin(&[3, 150, 14]).expect("begin");
        wide.draft(vec![97], 0, 2).expect("a first round");
        wide.feed(vec![200, 15, 97 + 127, 9], 0).expect("a piece");
        let drafts = wide.draft(vec![224, 35], 0, 4).expect("a round").tokens;
        assert!(drafts.iter().all(|&t| t < 97), "{drafts:?}");

        let mut narrow = spawn_unstarted(&dir, DraftAhead::Off);
        narrow.begin(&[3, last, 14]).expect("begin");
        narrow.draft(vec![last], 0, 2).expect("a first round");
        let expected = narrow
            .draft(vec![last, 15, last, 9, last, 35], 0, 4)
            .expect("stand-ins")
            .tokens;
        assert_eq!(drafts, expected);
    }

    /// Feeding before any prompt is an error at the next request, not a hang.
    #[test]
    fn feeding_without_a_prompt_fails_at_the_next_request() {
        let dir = model_dir(31);
        let mut thread = spawn_unstarted(&dir, DraftAhead::Off);
        thread
            .feed(vec![1, 2, 3], 0)
            .expect("sending does not wait");
        let e = thread.draft(vec![4], 0, 2).expect_err("no prompt was read");
        assert!(e.to_string().contains("no prompt"), "{e}");
    }

    /// Drafts are the model's greedy tokens after the committed sequence whether or not
    /// the thread drafted ahead; drafting ahead has them ready when a round keeps every
    /// draft and the target's token is the model's guess.
    #[test]
    fn drafting_ahead_comes_true_after_a_kept_round_and_never_changes_drafts() {
        let dir = model_dir(4);
        // One long greedy chain after the prompt and 35: c1..c9.
        let chain = greedy_chain(&dir, 9);
        let (mut ahead, mut plain) = (spawn(&dir, DraftAhead::On), spawn(&dir, DraftAhead::Off));
        let round = |t: &mut DraftThread, committed: &[u32]| {
            t.draft(committed.to_vec(), 0, 4).expect("draft")
        };

        let (a, p) = (round(&mut ahead, &[35]), round(&mut plain, &[35]));
        assert_eq!(a.tokens, chain[..4]);
        assert_eq!(p.tokens, chain[..4]);
        ahead.settle().expect("settle");
        // Every draft kept, and the target's token is c5, the model's own guess.
        let (a, p) = (
            round(&mut ahead, &chain[..5]),
            round(&mut plain, &chain[..5]),
        );
        assert_eq!(a.tokens, chain[5..9]);
        assert_eq!(p.tokens, chain[5..9]);
        assert_eq!((a.ready, p.ready), (4, 0));
        ahead.settle().expect("settle");
        // Two kept, then a token the model did not draft: drafting starts over there.
        let other = (a.tokens[2] + 1) % 97;
        let kept_two = [a.tokens[0], a.tokens[1], other];
        let (a, p) = (round(&mut ahead, &kept_two), round(&mut plain, &kept_two));
        assert_eq!(a.tokens, p.tokens);
        assert_eq!((a.ready, p.ready), (0, 0));
        // None kept.
        let (a, p) = (round(&mut ahead, &[7]), round(&mut plain, &[7]));
        assert_eq!(a.tokens, p.tokens);
        assert_eq!(a.ready, 0);
    }

    /// Eager: a round that came true takes the drafts that were ready, not `k`.
    #[test]
    fn eager_rounds_take_the_drafts_ready() {
        let dir = model_dir(4);
        let chain = greedy_chain(&dir, 9);
        let (mut eager, mut on) = (spawn(&dir, DraftAhead::Eager), spawn(&dir, DraftAhead::On));
        for t in [&mut eager, &mut on] {
            // Two drafts: ahead goes as far as the guess and two more.
            assert_eq!(t.draft(vec![35], 0, 2).expect("draft").tokens, chain[..2]);
            t.settle().expect("settle");
        }
        let came_true = chain[..3].to_vec();
        let e = eager.draft(came_true.clone(), 0, 4).expect("draft");
        assert_eq!((e.tokens.as_slice(), e.ready), (&chain[3..5], 2));
        let o = on.draft(came_true, 0, 4).expect("draft");
        assert_eq!((o.tokens.as_slice(), o.ready), (&chain[3..7], 2));
        // A round that starts over drafts `k` either way.
        let e = eager.draft(vec![(chain[5] + 1) % 97], 0, 4).expect("draft");
        assert_eq!((e.tokens.len(), e.ready), (4, 0));
    }

    /// After rounds that rejected drafts, the thread stops drafting ahead: a round that
    /// would have come true finds nothing ready.
    #[test]
    fn drafting_ahead_pauses_while_rounds_reject_drafts() {
        let dir = model_dir(5);
        // `mirror` sees the same committed sequence and drafts one more: the guess.
        let (mut gated, mut mirror) = (spawn(&dir, DraftAhead::On), spawn(&dir, DraftAhead::Off));
        let mut committed = vec![35];
        for _ in 0..8 {
            let drafts = gated.draft(committed.clone(), 0, 4).expect("draft").tokens;
            let with_guess = mirror.draft(committed.clone(), 0, 5).expect("draft").tokens;
            assert_eq!(drafts, with_guess[..4]);
            // The target rejects the first draft.
            committed = vec![(drafts[0] + 1) % 97];
        }
        gated.settle().expect("settle");
        let guess = mirror.draft(committed.clone(), 0, 5).expect("draft").tokens;
        let drafts = gated.draft(committed, 0, 4).expect("draft").tokens;
        assert_eq!(drafts, guess[..4]);
        gated.settle().expect("settle");
        let mut came_true = drafts.clone();
        came_true.push(guess[4]);
        let next = gated.draft(came_true, 0, 4).expect("draft");
        assert_eq!(next.ready, 0, "drafted ahead after eight rejecting rounds");
    }

    /// Sampled drafting reads logits after the committed sequence plus the tokens picked
    /// so far: their argmax is the greedy chain.
    #[test]
    fn logits_follow_the_committed_sequence_and_the_picked_tokens() {
        let dir = model_dir(6);
        let chain = greedy_chain(&dir, 3);
        let mut t = spawn(&dir, DraftAhead::On);
        let first = t.logits(vec![35], 0, vec![]).expect("logits");
        assert_eq!(first.len(), 97);
        assert_eq!(argmax(&first), chain[0]);
        let second = t.logits(vec![], 0, vec![chain[0]]).expect("logits");
        assert_eq!(argmax(&second), chain[1]);
        let third = t
            .logits(vec![], 0, vec![chain[0], chain[1]])
            .expect("logits");
        assert_eq!(argmax(&third), chain[2]);
        // Back to greedy drafting from the same committed sequence.
        assert_eq!(t.draft(vec![], 0, 3).expect("draft").tokens, chain);
    }

    #[test]
    fn drafting_without_a_prompt_is_an_error_not_a_hang() {
        let mut t = spawn_unstarted(&model_dir(2), DraftAhead::On);
        let err = t.draft(vec![1], 0, 2).expect_err("no prompt yet");
        assert!(err.to_string().contains("prompt"), "{err}");
        t.begin(&PROMPT).expect("begin");
        assert_eq!(t.draft(vec![1], 0, 2).expect("draft").tokens.len(), 2);
    }

    /// The model's guesses are checked on the committed tokens it reads from
    /// `check_from` on, whether fed in the background or read when drafting: the counts
    /// are those of one uncached forward over the whole sequence.
    #[test]
    fn guesses_are_checked_on_the_committed_tokens_read() {
        let dir = model_dir(7);
        // The model's own greedy continuation with every fourth token changed: some
        // guesses right, some wrong.
        let mut committed = vec![35];
        committed.extend(greedy_chain(&dir, 24).iter().enumerate().map(|(i, &t)| {
            if i % 4 == 3 {
                (t + 1) % 97
            } else {
                t
            }
        }));
        let sequence: Vec<u32> = PROMPT.iter().chain(&committed).copied().collect();
        let model = load_dir(dir.path(), &LoadOptions::default()).expect("load");
        let mut cache = model.new_cache();
        let logits = model
            .forward(
                &Array::from_slice(&sequence, &[1, sequence.len() as i32]),
                &mut cache,
                &[],
            )
            .expect("forward")
            .logits
            .as_dtype(Dtype::Float32)
            .expect("f32");
        logits.eval().expect("eval");
        let rows = logits.as_slice::<f32>();
        let vocab = rows.len() / sequence.len();
        let check_from = PROMPT.len() + 3;
        let expected = (check_from..sequence.len())
            .filter(|&p| argmax(&rows[(p - 1) * vocab..p * vocab]) == sequence[p])
            .count();
        assert!(
            expected > 0 && expected < sequence.len() - check_from,
            "a mix of right and wrong guesses: {expected}"
        );

        for fed_in_background in [true, false] {
            let mut t = spawn(&dir, DraftAhead::Off);
            if fed_in_background {
                t.feed(committed[..12].to_vec(), 3).expect("a piece");
                t.feed(committed[12..].to_vec(), 0).expect("the rest");
                t.draft(Vec::new(), 0, 1).expect("a round");
            } else {
                t.draft(committed.clone(), 3, 1).expect("a round");
            }
            assert_eq!(
                t.agreement(),
                Agreement {
                    agreed: expected,
                    checked: sequence.len() - check_from
                },
                "fed in the background: {fed_in_background}"
            );
            assert_eq!(t.agreement(), Agreement::default(), "counted once");
        }
    }
}
