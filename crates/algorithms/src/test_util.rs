//! What the unit tests of the collective state machines share: the
//! [`Machine`] glue of the instances they drive through the test network
//! ([`Net`]), and the setup, fault and check steps their scenarios repeat.

use crate::sim::testnet::{Machine, Net};
use crate::{CollKey, CommId, Nanos, Rank, SpId, Status};

/// The key of the tests' collective: job 1, communicator `id` led by rank 0,
/// sequence number `seq`.
pub(crate) const fn test_key(id: u32, seq: u64) -> CollKey {
    CollKey {
        job: 1,
        comm: CommId { leader: 0, id },
        seq,
    }
}

/// What a test asks of an instance besides the [`Machine`] calls.
pub(crate) trait Instance: Machine {
    fn finished(&self) -> bool;
    fn lose_peer(&mut self, now: Nanos, sp: SpId);
    fn lose_rank(&mut self, now: Nanos, rank: Rank);
}

/// Implements [`Instance`] for `$ty` through the collective itself (`self`)
/// or its field `$field`.
macro_rules! instance {
    ($ty:ty $(, $field:ident)?) => {
        impl crate::test_util::Instance for $ty {
            fn finished(&self) -> bool {
                self$(.$field)?.is_finished()
            }
            fn lose_peer(&mut self, now: Nanos, sp: SpId) {
                self$(.$field)?.handle_peer_lost(now, sp)
            }
            fn lose_rank(&mut self, now: Nanos, rank: Rank) {
                self$(.$field)?.handle_rank_lost(now, rank)
            }
        }
    };
}
pub(crate) use instance;

/// The `post` and `msg` methods of a [`Machine`] impl: they hand the input to
/// the collective (`self`, or its field `$field`) and panic if it is rejected.
macro_rules! forward_inputs {
    ($($field:ident)?) => {
        fn post(&mut self, now: Nanos, post: Self::Post) {
            self$(.$field)?.handle_post(now, post).unwrap();
        }

        fn msg(&mut self, now: Nanos, from: SpId, msg: Self::Msg) {
            self$(.$field)?.handle_msg(now, from, msg).unwrap();
        }
    };
}
pub(crate) use forward_inputs;

/// [`Machine`] and [`Instance`] for `$machine<Tag>`, a collective whose only
/// actions are sends, copies and completions, created with `Config { me }`
/// and `KEY`; `$extra` are further methods of the `Machine` impl.
macro_rules! plain_machine {
    ($machine:ident $(, $($extra:tt)+)?) => {
        impl Machine for $machine<Tag> {
            type Post = Post<Tag>;
            type Msg = Msg<Tag>;
            type Copy = Copy<Tag>;

            fn create(sp: SpId) -> Self {
                $machine::new(KEY, Config { me: sp })
            }

            crate::test_util::forward_inputs!();

            fn copy_done(&mut self, now: Nanos, copy: &Copy<Tag>, status: Status) {
                self.handle_copy_done(now, copy.id, status);
            }

            fn poll(&mut self) -> Option<Out<Msg<Tag>, Copy<Tag>>> {
                Some(match self.poll_action()? {
                    Action::Send { to, msg } => Out::Send { to, msg },
                    Action::Copy(c) => Out::Copy(c),
                    Action::Complete { rank, status } => Out::Complete { rank, status },
                })
            }

            $($($extra)+)?
        }

        crate::test_util::instance!($machine<Tag>);
    };
}
pub(crate) use plain_machine;

/// Posts `post(r)` for each rank `r` of `ranks`, in that order, at the SP
/// serving it (`members[r]`).
pub(crate) fn post_ranks<A: Machine>(
    net: &mut Net<A>,
    members: &[SpId],
    ranks: impl IntoIterator<Item = Rank>,
    post: impl Fn(Rank) -> A::Post,
) {
    for r in ranks {
        net.post(members[r as usize], post(r));
    }
}

/// A net of `sps` SPs where the ranks `ranks` posted `post(r)`, in that
/// order, at their SPs (`members[r]`).
pub(crate) fn posted<A: Machine>(
    sps: u32,
    members: &[SpId],
    ranks: impl IntoIterator<Item = Rank>,
    post: impl Fn(Rank) -> A::Post,
) -> Net<A> {
    let mut net = Net::new(sps);
    post_ranks(&mut net, members, ranks, post);
    net
}

/// Runs the net until quiet: all ranks of a communicator of `size` completed
/// `Ok`.
pub(crate) fn run_all_ok<A: Machine>(net: &mut Net<A>, size: usize) {
    net.run();
    let all: Vec<Rank> = (0..size as Rank).collect();
    net.expect_status(&all, Some(Status::Ok));
}

/// SP `lost` died: each SP of `told` learns it at `now` and its outputs are
/// taken.
pub(crate) fn tell_peer_lost<A: Instance>(net: &mut Net<A>, now: Nanos, lost: SpId, told: &[SpId]) {
    for &sp in told {
        net.sp(sp).lose_peer(now, lost);
        net.collect(sp);
    }
}

/// Asserts that the instance of every SP of `sps` is finished.
pub(crate) fn all_finished<A: Instance>(net: &mut Net<A>, sps: &[SpId]) {
    for &sp in sps {
        assert!(net.sp(sp).finished(), "sp {sp} not finished");
    }
}

/// Puts the first copy in flight that `pick` selects at the front of the
/// queue (for `finish_copy`); false if there is none.
pub(crate) fn copy_first<A: Machine>(
    net: &mut Net<A>,
    pick: impl Fn(&(SpId, A::Copy)) -> bool,
) -> bool {
    let Some(i) = net.copies.iter().position(pick) else {
        return false;
    };
    let w = net.copies.remove(i).unwrap();
    net.copies.push_front(w);
    true
}

/// On `sps` SPs, every rank of `members` posts `post(r)` (empty blocks):
/// all complete `Ok` and nothing is copied. Returns the quiet net.
pub(crate) fn zero_bytes_without_copies<A: Machine>(
    sps: u32,
    members: &[SpId],
    post: impl Fn(Rank) -> A::Post,
) -> Net<A> {
    let mut net = posted(sps, members, 0..members.len() as Rank, post);
    run_all_ok(&mut net, members.len());
    assert!(net.copied.is_empty());
    net
}

/// Three SPs on three nodes, rank `r` alone on SP `r`: rank 1 dies before
/// posting (SP 1 learns it first), ranks 0 and 2 post `post(r)`. Both fail
/// with `RankFailed`, rank 1 never completes, SPs 0 and 2 finish.
pub(crate) fn rank_1_lost_before_posting<A: Instance>(post: impl Fn(Rank) -> A::Post) {
    let mut net = Net::<A>::new(3);
    net.sp(1).lose_rank(0, 1);
    post_ranks(&mut net, &[0, 1, 2], [0, 2], post);
    net.run();
    net.expect_status(&[0, 2], Some(Status::RankFailed));
    assert_eq!(net.status(1), None);
    all_finished(&mut net, &[0, 2]);
}

/// Three SPs on three nodes, rank `r` alone on SP `r`, each posts `post(r)`
/// and rank 2's length disagrees: the net runs until quiet, every rank
/// completed, rank 2 with `CountMismatch`, and every SP finished.
pub(crate) fn rank_2_length_mismatch<A: Instance>(post: impl Fn(Rank) -> A::Post) -> Net<A> {
    let mut net = posted(3, &[0, 1, 2], 0..3, post);
    net.run();
    assert_eq!(net.status(2), Some(Status::CountMismatch));
    for r in 0..3 {
        assert!(net.status(r).is_some(), "rank {r}");
    }
    all_finished(&mut net, &[0, 1, 2]);
    net
}

/// Rank `r` alone on SP `r`: SP `lost` dies, the SPs `survivors` learn it at
/// time 100, and once the net is quiet their ranks failed with `PeerFailed`
/// and they are finished.
pub(crate) fn lose_sp<A: Instance>(net: &mut Net<A>, lost: SpId, survivors: &[SpId]) {
    net.dead.insert(lost);
    tell_peer_lost(net, 100, lost, survivors);
    net.run();
    net.expect_status(survivors, Some(Status::PeerFailed));
    all_finished(net, survivors);
}

/// The oldest copy in flight fails; once the net is quiet, ranks 0 and 1
/// (alone on SPs 0 and 1) failed with `AccessError` and the SPs finished.
pub(crate) fn fail_a_copy<A: Instance>(net: &mut Net<A>) {
    assert!(net.finish_copy(Status::AccessError));
    net.run();
    net.expect_status(&[0, 1], Some(Status::AccessError));
    all_finished(net, &[0, 1]);
}
