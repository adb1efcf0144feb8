//! Everything two parties need to agree on before a collective can run: the cluster
//! description (which SPs exist, where they listen, which host each node is), the placement of
//! world ranks on nodes and SPs from what the ranks learn at `MPI_Init`, the wire protocol
//! spoken between host ranks and SPs and among SPs (serde + bincode in length-prefixed frames,
//! a versioned hello), what each collective kind is to every side ([`kinds`]), the completion
//! mailbox layout, and the bounded
//! connect-with-backoff used for SP rendezvous. It holds no event loop and no global state; it
//! touches sockets only through `std::io::Read`/`Write` (see [`wire::Channel`]).

pub mod auth;
pub mod cluster;
pub mod cpus;
pub mod kinds;
pub mod mailbox;
pub mod placement;
pub mod post_ring;
pub mod rendezvous;
pub mod stamps;
#[doc(hidden)]
pub mod testing;
pub mod wire;

pub use cluster::{Cluster, Layout, Placement};
