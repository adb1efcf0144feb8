//! The service process (SP): the daemon that progresses collectives for host MPI ranks, and the
//! launcher that starts an emulated cluster of them on one machine. An SP owns no application
//! data: it only moves bytes between regions that host ranks granted it, and it decides nothing
//! that the collective's state machine (in `algorithms`) does not ask for.
//!
//! Modules: [`server`] (event loop and engine), [`drivers`] (one per collective kind, behind
//! one interface), [`validate`] (every check of a descriptor), [`conn`] (framed nonblocking connections),
//! [`access`] (who may use the SP and how much), [`mesh`] (the authenticated SP mesh),
//! [`datapath`] (copy worker threads), [`launch`] (the emulated cluster), [`cpus`] (CPU lists and pinning), [`stats`],
//! [`cluster_cmd`] (`cluster check|init`: the description of a real cluster).
#![deny(unsafe_op_in_unsafe_fn)]

pub mod access;
pub mod canary_netns;
pub mod canary_plane;
pub mod canary_resources;
pub mod canary_switch;
pub mod canary_tree;
pub mod cluster_cmd;
pub mod conn;
pub mod cpus;
pub mod datapath;
pub mod deploy;
pub mod drivers;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod held;
pub mod hostlist;
pub mod launch;
pub mod launch_mpi;
pub mod mcast;
pub mod mesh;
pub mod post_ring;
pub mod qdisc;
pub mod record;
pub mod segment;
pub mod server;
pub mod signals;
pub mod simulate;
pub mod staged_resources;
pub mod staging;
pub mod stats;
pub mod stopped;
pub mod validate;
