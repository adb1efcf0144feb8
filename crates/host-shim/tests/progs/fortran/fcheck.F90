! Checks the offloaded collectives called from Fortran, natively or with libhost_shim.so
! preloaded: the same binary must give the same answers either way.
!
! One source, three programs: compiled with -DF08 it uses `use mpi_f08`, with -DUSE_MPI
! `use mpi`, otherwise `include 'mpif.h'`.
!
! Usage: fcheck ROUNDS SEED. Every round runs, on MPI_COMM_WORLD and on two sub-communicators
! (the even and odd ranks, in reverse order), MPI_Alltoallv, MPI_Ialltoallv, MPI_Alltoall
! (with MPI_IN_PLACE), MPI_Ialltoall, MPI_Allgatherv (also with MPI_IN_PLACE), MPI_Iallgatherv,
! MPI_Allgather (with a derived type), MPI_Iallgather, MPI_Bcast (also with a strided type and
! of MPI_BOTTOM) and MPI_Ibcast, with counts drawn from SEED (zeros included), completed by
! every call of the Wait/Test family, mixed with native point-to-point requests and
! MPI_REQUEST_NULL, with statuses and with MPI_STATUS(ES)_IGNORE; erroneous calls under
! MPI_ERRORS_RETURN; MPI_Init_thread under mpi_f08, MPI_Init otherwise. Every result is
! compared with a native reference (`ref_*`: the same collective through the library's
! Fortran PMPI_* binding, or under MPICH, whose PMPI_* binding calls the C MPI_* functions,
! native calls the shim never intercepts).
! Prints "NAME: all ok (N checks on rank 0,
! S ranks, E eligible calls per rank)" on rank 0 when every rank passed, "NAME: F failures"
! otherwise (exit 1); E counts the calls the shim offloads, the same on every rank.

#if defined(F08)
#define NAME "fcheck_f08"
#define COMM_T type(MPI_Comm)
#define TYPE_T type(MPI_Datatype)
#define REQ_T type(MPI_Request)
#define STATUS_T type(MPI_Status)
#define ONE_STATUS
#define STATUSES(n) (n)
#define SOURCE_OF(s, i) s(i)%MPI_SOURCE
#define TAG_OF(s, i) s(i)%MPI_TAG
#define SOURCE1(s) s%MPI_SOURCE
#define TAG1(s) s%MPI_TAG
#else
#if defined(USE_MPI)
#define NAME "fcheck_mpi"
#else
#define NAME "fcheck_mpifh"
#endif
#define COMM_T integer
#define TYPE_T integer
#define REQ_T integer
#define STATUS_T integer
#define ONE_STATUS (MPI_STATUS_SIZE)
#define STATUSES(n) (MPI_STATUS_SIZE, n)
#define SOURCE_OF(s, i) s(MPI_SOURCE, i)
#define TAG_OF(s, i) s(MPI_TAG, i)
#define SOURCE1(s) s(MPI_SOURCE)
#define TAG1(s) s(MPI_TAG)
#endif

program fcheck
#if defined(F08)
    use mpi_f08
#elif defined(USE_MPI)
    use mpi
#endif
    implicit none
#if !defined(F08) && !defined(USE_MPI)
    include 'mpif.h'
#endif
    character(len=*), parameter :: prog = NAME
    integer :: rank, nranks, failures, checks, eligible, ierr, rounds, round, all_failures
    integer(8) :: shared_rng, local_rng, seed
    character(len=32) :: arg
    COMM_T :: sub, comms(3)
    integer :: c, ignored_before(6), ignored_after(6), vlen
#if defined(F08)
    integer :: provided
#endif
    character(len=MPI_MAX_LIBRARY_VERSION_STRING) :: version
    logical :: is_mpich

#if defined(F08)
    call MPI_Init_thread(MPI_THREAD_FUNNELED, provided, ierr)
#else
    call MPI_Init(ierr)
#endif
    call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
    call MPI_Comm_size(MPI_COMM_WORLD, nranks, ierr)
    call MPI_Get_library_version(version, vlen, ierr)
    is_mpich = index(version, 'MPICH') > 0
    failures = 0
    checks = 0
    eligible = 0
    rounds = 2
    seed = 1
    if (command_argument_count() >= 1) then
        call get_command_argument(1, arg)
        read (arg, *) rounds
    end if
    if (command_argument_count() >= 2) then
        call get_command_argument(2, arg)
        read (arg, *) seed
    end if
    if (rank == 0) print '(A, " seed ", I0, ", ", I0, " rounds")', prog, seed, rounds
    shared_rng = seed * 2654435761_8 + 88172645463325252_8
    local_rng = shared_rng + 7919_8 * (rank + 1)

    call ignored(ignored_before)
    call MPI_Comm_split(MPI_COMM_WORLD, mod(rank, 2), nranks - rank, sub, ierr)
    comms(1) = MPI_COMM_WORLD
    comms(2) = sub
    comms(3) = MPI_COMM_WORLD
    do round = 1, rounds
        do c = 1, 3
            call alltoallv_tests(comms(c), c == 3)
            call alltoall_tests(comms(c))
            call allgatherv_tests(comms(c), c == 3)
            call allgather_tests(comms(c))
            call bcast_tests(comms(c), c == 3)
        end do
        call family_tests(round)
    end do
    call MPI_Comm_free(sub, ierr)
    call error_tests()
    ! Nothing was written through MPI_STATUS_IGNORE or MPI_STATUSES_IGNORE.
    call ignored(ignored_after)
    call check(all(ignored_before == ignored_after), "MPI_STATUS(ES)_IGNORE were written")

    call MPI_Allreduce(failures, all_failures, 1, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD, ierr)
    if (rank == 0) then
        if (all_failures == 0) then
            print '(A, ": all ok (", I0, " checks on rank 0, ", I0, " ranks, ", I0, &
                & " eligible calls per rank)")', prog, checks, nranks, eligible
        else
            print '(A, ": ", I0, " failures")', prog, all_failures
        end if
    end if
    call MPI_Finalize(ierr)
    if (all_failures /= 0) stop 1

contains

    ! xorshift64: `shared` draws are the same on every rank, local ones are the rank's own.
    integer function draw(state, n)
        integer(8), intent(inout) :: state
        integer, intent(in) :: n
        state = ieor(state, ishft(state, 13))
        state = ieor(state, ishft(state, -7))
        state = ieor(state, ishft(state, 17))
        draw = int(modulo(state, int(n, 8)))
    end function

    ! A count: zero a quarter of the time, now and then large.
    integer function a_count()
        select case (draw(shared_rng, 8))
        case (0, 1)
            a_count = 0
        case (2)
            a_count = 5000 + draw(shared_rng, 20000)
        case default
            a_count = 1 + draw(shared_rng, 300)
        end select
    end function

    ! The first fields of MPI_STATUS_IGNORE and MPI_STATUSES_IGNORE (variables of the library).
    subroutine ignored(v)
        integer, intent(out) :: v(6)
#if defined(F08)
        v(1) = MPI_STATUS_IGNORE%MPI_SOURCE
        v(2) = MPI_STATUS_IGNORE%MPI_TAG
        v(3) = MPI_STATUS_IGNORE%MPI_ERROR
        v(4) = MPI_STATUSES_IGNORE(1)%MPI_SOURCE
        v(5) = MPI_STATUSES_IGNORE(1)%MPI_TAG
        v(6) = MPI_STATUSES_IGNORE(1)%MPI_ERROR
#else
        v(1:3) = MPI_STATUS_IGNORE(1:3)
        v(4:6) = MPI_STATUSES_IGNORE(1:3, 1)
#endif
    end subroutine

    ! Erroneous calls under MPI_ERRORS_RETURN: the error comes back in ierror (the calls go to
    ! the native functions, which report them, so they are not eligible).
    subroutine error_tests()
        COMM_T :: dup
        REQ_T :: req
        integer :: buf(4)
        call MPI_Comm_dup(MPI_COMM_WORLD, dup, ierr)
        call MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN, ierr)
        buf = rank
        ierr = MPI_SUCCESS
        call MPI_Bcast(buf, 4, MPI_INTEGER, nranks, dup, ierr)
        call check(ierr /= MPI_SUCCESS, "MPI_Bcast with a root outside: an error in ierror")
        ierr = MPI_SUCCESS
        call MPI_Ibcast(buf, -1, MPI_INTEGER, 0, dup, req, ierr)
        call check(ierr /= MPI_SUCCESS, "MPI_Ibcast with a negative count: an error in ierror")
        ierr = MPI_SUCCESS
        call MPI_Allgather(buf, 1, MPI_DATATYPE_NULL, buf, 1, MPI_INTEGER, dup, ierr)
        call check(ierr /= MPI_SUCCESS, "MPI_Allgather of MPI_DATATYPE_NULL: an error in ierror")
        call MPI_Comm_free(dup, ierr)
    end subroutine

    ! The native references. Where the library's Fortran PMPI_* binding is native (Open MPI)
    ! they are the same collective through PMPI_*. MPICH's Fortran binding (PMPI_* included)
    ! calls the C MPI_* functions, which the shim intercepts: there the references are native
    ! calls the shim never intercepts (MPI_Alltoallw, MPI_Gatherv to every root, MPI_Send and
    ! MPI_Recv from the root).
    subroutine ref_alltoallv(sbuf, sc, sd, rbuf, rc, rd, comm)
        integer, intent(in) :: sbuf(*), sc(0:*), sd(0:*), rc(0:*), rd(0:*)
        integer, intent(inout) :: rbuf(*)
        COMM_T, intent(in) :: comm
        integer :: n, i, isz, sdb(0:nranks - 1), rdb(0:nranks - 1)
        TYPE_T :: types(0:nranks - 1)
        if (.not. is_mpich) then
            call PMPI_Alltoallv(sbuf, sc, sd, MPI_INTEGER, rbuf, rc, rd, MPI_INTEGER, comm, ierr)
            return
        end if
        call MPI_Comm_size(comm, n, ierr)
        call MPI_Type_size(MPI_INTEGER, isz, ierr)
        do i = 0, n - 1
            sdb(i) = isz * sd(i)
            rdb(i) = isz * rd(i)
            types(i) = MPI_INTEGER
        end do
        call MPI_Alltoallw(sbuf, sc, sdb, types, rbuf, rc, rdb, types, comm, ierr)
    end subroutine

    subroutine ref_alltoall(sbuf, k, rbuf, comm)
        integer, intent(in) :: sbuf(*), k
        integer, intent(inout) :: rbuf(*)
        COMM_T, intent(in) :: comm
        integer :: n, i, counts(0:nranks - 1), displs(0:nranks - 1)
        if (.not. is_mpich) then
            call PMPI_Alltoall(sbuf, k, MPI_INTEGER, rbuf, k, MPI_INTEGER, comm, ierr)
            return
        end if
        call MPI_Comm_size(comm, n, ierr)
        do i = 0, n - 1
            counts(i) = k
            displs(i) = i * k
        end do
        call ref_alltoallv(sbuf, counts, displs, rbuf, counts, displs, comm)
    end subroutine

    subroutine ref_allgatherv(sbuf, scount, rbuf, rc, displs, comm)
        integer, intent(in) :: sbuf(*), scount, rc(0:*), displs(0:*)
        integer, intent(inout) :: rbuf(*)
        COMM_T, intent(in) :: comm
        integer :: n, root
        if (.not. is_mpich) then
            call PMPI_Allgatherv(sbuf, scount, MPI_INTEGER, rbuf, rc, displs, MPI_INTEGER, comm, &
                & ierr)
            return
        end if
        call MPI_Comm_size(comm, n, ierr)
        do root = 0, n - 1
            call MPI_Gatherv(sbuf, scount, MPI_INTEGER, rbuf, rc, displs, MPI_INTEGER, root, &
                & comm, ierr)
        end do
    end subroutine

    subroutine ref_allgather(sbuf, k, rbuf, comm)
        integer, intent(in) :: sbuf(*), k
        integer, intent(inout) :: rbuf(*)
        COMM_T, intent(in) :: comm
        integer :: n, i, counts(0:nranks - 1), displs(0:nranks - 1)
        if (.not. is_mpich) then
            call PMPI_Allgather(sbuf, k, MPI_INTEGER, rbuf, k, MPI_INTEGER, comm, ierr)
            return
        end if
        call MPI_Comm_size(comm, n, ierr)
        do i = 0, n - 1
            counts(i) = k
            displs(i) = i * k
        end do
        call ref_allgatherv(sbuf, k, rbuf, counts, displs, comm)
    end subroutine

    subroutine ref_bcast(buf, count, dtype, root, comm)
        integer, intent(inout) :: buf(*)
        integer, intent(in) :: count, root
        TYPE_T, intent(in) :: dtype
        COMM_T, intent(in) :: comm
        integer :: n, me, d
        if (.not. is_mpich) then
            call PMPI_Bcast(buf, count, dtype, root, comm, ierr)
            return
        end if
        call MPI_Comm_size(comm, n, ierr)
        call MPI_Comm_rank(comm, me, ierr)
        if (me == root) then
            do d = 0, n - 1
                if (d /= root) call MPI_Send(buf, count, dtype, d, 9999, comm, ierr)
            end do
        else
            call MPI_Recv(buf, count, dtype, root, 9999, comm, MPI_STATUS_IGNORE, ierr)
        end if
    end subroutine

    subroutine check(ok, what)
        logical, intent(in) :: ok
        character(len=*), intent(in) :: what
        checks = checks + 1
        if (.not. ok) then
            failures = failures + 1
            if (failures < 10) print '("rank ", I0, ": check failed: ", A)', rank, what
        end if
    end subroutine

    subroutine fill(buf, n)
        integer, intent(out) :: buf(:)
        integer, intent(in) :: n
        integer :: i
        do i = 1, n
            buf(i) = rank * 1000000 + draw(local_rng, 999999)
        end do
    end subroutine

    ! Waits for `req` the way `how` (0..3) says: MPI_Wait, an MPI_Test loop, MPI_Waitall of one,
    ! MPI_Request_get_status then MPI_Wait with MPI_STATUS_IGNORE.
    subroutine complete(req, how)
        REQ_T, intent(inout) :: req
        integer, intent(in) :: how
        STATUS_T :: st ONE_STATUS
        REQ_T :: reqs(1)
        logical :: flag
        select case (how)
        case (0)
            call MPI_Wait(req, st, ierr)
        case (1)
            flag = .false.
            do while (.not. flag)
                call MPI_Test(req, flag, MPI_STATUS_IGNORE, ierr)
            end do
        case (2)
            reqs(1) = req
            call MPI_Waitall(1, reqs, MPI_STATUSES_IGNORE, ierr)
            req = reqs(1)
        case default
            flag = .false.
            do while (.not. flag)
                call MPI_Request_get_status(req, flag, st, ierr)
            end do
            call MPI_Wait(req, MPI_STATUS_IGNORE, ierr)
        end select
        call check(ierr == MPI_SUCCESS, "completion returned an error")
        call check(req == MPI_REQUEST_NULL, "a completed request is MPI_REQUEST_NULL")
    end subroutine

    ! Counts and displacements (with gaps) of an alltoallv on `comm` of `n` ranks, `me` in it.
    subroutine v_layout(n, me, sc, sd, rc, rd, stotal, rtotal)
        integer, intent(in) :: n, me
        integer, intent(out) :: sc(0:), sd(0:), rc(0:), rd(0:), stotal, rtotal
        integer :: cnt(0:nranks - 1, 0:nranks - 1), s, d
        do s = 0, nranks - 1
            do d = 0, nranks - 1
                cnt(s, d) = a_count()
            end do
        end do
        stotal = 0
        rtotal = 0
        do d = 0, n - 1
            sc(d) = cnt(me, d)
            sd(d) = stotal
            stotal = stotal + sc(d) + mod(d, 3)
            rc(d) = cnt(d, me)
            rd(d) = rtotal
            rtotal = rtotal + rc(d) + mod(d, 2)
        end do
    end subroutine

    subroutine alltoallv_tests(comm, nonblocking)
        COMM_T, intent(in) :: comm
        logical, intent(in) :: nonblocking
        integer :: n, me, stotal, rtotal
        integer, allocatable :: sc(:), sd(:), rc(:), rd(:), sbuf(:), rbuf(:), ref(:)
        REQ_T :: req
        call MPI_Comm_size(comm, n, ierr)
        call MPI_Comm_rank(comm, me, ierr)
        allocate (sc(0:n - 1), sd(0:n - 1), rc(0:n - 1), rd(0:n - 1))
        call v_layout(n, me, sc, sd, rc, rd, stotal, rtotal)
        allocate (sbuf(max(stotal, 1)), rbuf(max(rtotal, 1)), ref(max(rtotal, 1)))
        call fill(sbuf, size(sbuf))
        rbuf = -7
        ref = -7
        if (nonblocking) then
            call MPI_Ialltoallv(sbuf, sc, sd, MPI_INTEGER, rbuf, rc, rd, MPI_INTEGER, comm, &
                & req, ierr)
            call check(req /= MPI_REQUEST_NULL, "Ialltoallv gave a request")
            call complete(req, draw(shared_rng, 4))
        else
            call MPI_Alltoallv(sbuf, sc, sd, MPI_INTEGER, rbuf, rc, rd, MPI_INTEGER, comm, ierr)
        end if
        eligible = eligible + 1
        call check(ierr == MPI_SUCCESS, "MPI_(I)alltoallv returned an error")
        call ref_alltoallv(sbuf, sc, sd, ref, rc, rd, comm)
        call check(all(rbuf == ref), "MPI_(I)alltoallv differs from the native Alltoallv")
    end subroutine

    subroutine alltoall_tests(comm)
        COMM_T, intent(in) :: comm
        integer :: n, k
        integer, allocatable :: sbuf(:), rbuf(:), ref(:), inplace(:)
        REQ_T :: req
        call MPI_Comm_size(comm, n, ierr)
        k = a_count()
        allocate (sbuf(max(k * n, 1)), rbuf(max(k * n, 1)), ref(max(k * n, 1)))
        call fill(sbuf, size(sbuf))
        rbuf = -7
        ref = -7
        call MPI_Ialltoall(sbuf, k, MPI_INTEGER, rbuf, k, MPI_INTEGER, comm, req, ierr)
        call complete(req, draw(shared_rng, 4))
        eligible = eligible + 1
        call ref_alltoall(sbuf, k, ref, comm)
        call check(all(rbuf == ref), "MPI_Ialltoall differs from the native Alltoall")
        ! In place: the receive buffer holds what is sent.
        inplace = sbuf
        call MPI_Alltoall(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, inplace, k, MPI_INTEGER, comm, ierr)
        eligible = eligible + 1
        call check(ierr == MPI_SUCCESS, "MPI_Alltoall in place returned an error")
        call check(all(inplace(1:k * n) == ref(1:k * n)), &
            & "MPI_Alltoall(MPI_IN_PLACE) differs from the native Alltoall")
    end subroutine

    subroutine allgatherv_tests(comm, nonblocking)
        COMM_T, intent(in) :: comm
        logical, intent(in) :: nonblocking
        integer :: n, me, i, total, cnt(0:nranks - 1)
        integer, allocatable :: rc(:), displs(:), sbuf(:), rbuf(:), ref(:)
        REQ_T :: req
        call MPI_Comm_size(comm, n, ierr)
        call MPI_Comm_rank(comm, me, ierr)
        do i = 0, nranks - 1
            cnt(i) = a_count()
        end do
        allocate (rc(0:n - 1), displs(0:n - 1))
        total = 0
        do i = 0, n - 1
            rc(i) = cnt(i)
            displs(i) = total
            total = total + rc(i) + mod(i, 2)
        end do
        allocate (sbuf(max(rc(me), 1)), rbuf(max(total, 1)), ref(max(total, 1)))
        call fill(sbuf, size(sbuf))
        rbuf = -7
        ref = -7
        if (nonblocking) then
            call MPI_Iallgatherv(sbuf, rc(me), MPI_INTEGER, rbuf, rc, displs, MPI_INTEGER, &
                & comm, req, ierr)
            call complete(req, draw(shared_rng, 4))
        else
            call MPI_Allgatherv(sbuf, rc(me), MPI_INTEGER, rbuf, rc, displs, MPI_INTEGER, &
                & comm, ierr)
        end if
        eligible = eligible + 1
        call ref_allgatherv(sbuf, rc(me), ref, rc, displs, comm)
        call check(all(rbuf == ref), "MPI_(I)allgatherv differs from the native Allgatherv")
        ! In place: this rank's block is already in the receive buffer.
        rbuf = -7
        if (rc(me) > 0) rbuf(displs(me) + 1:displs(me) + rc(me)) = sbuf(1:rc(me))
        call MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, rbuf, rc, displs, MPI_INTEGER, &
            & comm, ierr)
        eligible = eligible + 1
        call check(all(rbuf == ref), "MPI_Allgatherv(MPI_IN_PLACE) differs from the native Allgatherv")
    end subroutine

    subroutine allgather_tests(comm)
        COMM_T, intent(in) :: comm
        integer :: n, k
        integer, allocatable :: sbuf(:), rbuf(:), ref(:)
        TYPE_T :: pair
        REQ_T :: req
        call MPI_Comm_size(comm, n, ierr)
        k = a_count()
        allocate (sbuf(max(2 * k, 1)), rbuf(max(2 * k * n, 1)), ref(max(2 * k * n, 1)))
        call fill(sbuf, size(sbuf))
        rbuf = -7
        ref = -7
        ! A derived type on the send side: two integers.
        call MPI_Type_contiguous(2, MPI_INTEGER, pair, ierr)
        call MPI_Type_commit(pair, ierr)
        call MPI_Allgather(sbuf, k, pair, rbuf, 2 * k, MPI_INTEGER, comm, ierr)
        eligible = eligible + 1
        call ref_allgather(sbuf, 2 * k, ref, comm)
        call check(all(rbuf == ref), "MPI_Allgather differs from the native Allgather")
        rbuf = -7
        call MPI_Iallgather(sbuf, 2 * k, MPI_INTEGER, rbuf, k, pair, comm, req, ierr)
        call complete(req, draw(shared_rng, 4))
        eligible = eligible + 1
        call check(all(rbuf == ref), "MPI_Iallgather differs from the native Allgather")
        call MPI_Type_free(pair, ierr)
    end subroutine

    subroutine bcast_tests(comm, nonblocking)
        COMM_T, intent(in) :: comm
        logical, intent(in) :: nonblocking
        integer :: n, me, k, root
        integer, allocatable :: buf(:), ref(:)
        TYPE_T :: strided, absolute
        REQ_T :: req
        integer(kind=MPI_ADDRESS_KIND) :: addr(1)
        integer :: blocks(1)
        call MPI_Comm_size(comm, n, ierr)
        call MPI_Comm_rank(comm, me, ierr)
        k = a_count()
        root = draw(shared_rng, n)
        allocate (buf(max(2 * k, 1)), ref(max(2 * k, 1)))
        call fill(ref, size(ref))
        buf = ref
        if (nonblocking) then
            call MPI_Ibcast(buf, k, MPI_INTEGER, root, comm, req, ierr)
            call complete(req, draw(shared_rng, 4))
        else
#if defined(F08)
            ! ierror is optional in mpi_f08.
            call MPI_Bcast(buf, k, MPI_INTEGER, root, comm)
#else
            call MPI_Bcast(buf, k, MPI_INTEGER, root, comm, ierr)
#endif
        end if
        eligible = eligible + 1
        call ref_bcast(ref, k, MPI_INTEGER, root, comm)
        call check(all(buf == ref), "MPI_(I)bcast differs from the native Bcast")
        ! Every other integer: a side that is not one run of bytes (packed by the shim).
        call MPI_Type_vector(k, 1, 2, MPI_INTEGER, strided, ierr)
        call MPI_Type_commit(strided, ierr)
        call fill(ref, size(ref))
        buf = ref
        call MPI_Bcast(buf, 1, strided, root, comm, ierr)
        eligible = eligible + 1
        call ref_bcast(ref, 1, strided, root, comm)
        call check(all(buf == ref), "MPI_Bcast of a strided type differs from the native Bcast")
        call MPI_Type_free(strided, ierr)
        ! MPI_BOTTOM with a type holding the buffer's absolute address.
        call MPI_Get_address(buf, addr(1), ierr)
        blocks(1) = k
        call MPI_Type_create_hindexed(1, blocks, addr, MPI_INTEGER, absolute, ierr)
        call MPI_Type_commit(absolute, ierr)
        call fill(ref, size(ref))
        buf = ref
        call MPI_Bcast(MPI_BOTTOM, 1, absolute, root, comm, ierr)
        eligible = eligible + 1
        call ref_bcast(ref, k, MPI_INTEGER, root, comm)
        call check(all(buf == ref), "MPI_Bcast(MPI_BOTTOM) differs from the native Bcast")
        call MPI_Type_free(absolute, ierr)
    end subroutine

    ! Offloaded and native requests (and MPI_REQUEST_NULL) in one array, completed by
    ! MPI_Waitall, MPI_Testall, MPI_Waitany, MPI_Testany, MPI_Waitsome and MPI_Testsome.
    subroutine family_tests(round)
        integer, intent(in) :: round
        integer, parameter :: nreq = 6
        REQ_T :: reqs(nreq)
        STATUS_T :: sts STATUSES(nreq)
        STATUS_T :: st ONE_STATUS
        integer :: how, k, i, idx, outcount, indices(nreq), done, left, right, tag
        integer :: bc(400), bc_ref(400), ag(400 * nranks), ag_ref(400 * nranks)
        integer :: a2a(50 * nranks), a2a_out(50 * nranks), a2a_ref(50 * nranks)
        integer :: sendv(16), recvv(16)
        logical :: flag, seen(nreq)
        left = modulo(rank - 1, nranks)
        right = modulo(rank + 1, nranks)
        do how = 0, 5
            k = 1 + draw(shared_rng, 400)
            tag = round * 10 + how
            call fill(bc_ref, 400)
            bc = bc_ref
            call fill(a2a, size(a2a))
            ag = -7
            a2a_out = -7
            sendv = rank * 100 + how
            recvv = -1
            call MPI_Ibcast(bc, k, MPI_INTEGER, mod(how, nranks), MPI_COMM_WORLD, reqs(1), ierr)
            call MPI_Irecv(recvv, 16, MPI_INTEGER, left, tag, MPI_COMM_WORLD, reqs(2), ierr)
            call MPI_Iallgather(bc_ref, k, MPI_INTEGER, ag, k, MPI_INTEGER, MPI_COMM_WORLD, &
                & reqs(3), ierr)
            reqs(4) = MPI_REQUEST_NULL
            call MPI_Isend(sendv, 16, MPI_INTEGER, right, tag, MPI_COMM_WORLD, reqs(5), ierr)
            call MPI_Ialltoall(a2a, 50, MPI_INTEGER, a2a_out, 50, MPI_INTEGER, MPI_COMM_WORLD, &
                & reqs(6), ierr)
            eligible = eligible + 3
            select case (how)
            case (0)
                call MPI_Waitall(nreq, reqs, sts, ierr)
                call check(SOURCE_OF(sts, 2) == left .and. TAG_OF(sts, 2) == tag, &
                    & "MPI_Waitall: the receive's status")
            case (1)
                flag = .false.
                do while (.not. flag)
                    call MPI_Testall(nreq, reqs, flag, MPI_STATUSES_IGNORE, ierr)
                end do
            case (2, 3)
                seen = .false.
                seen(4) = .true.
                do done = 1, nreq - 1
                    if (how == 2) then
                        call MPI_Waitany(nreq, reqs, idx, st, ierr)
                    else
                        flag = .false.
                        do while (.not. flag)
                            call MPI_Testany(nreq, reqs, idx, flag, st, ierr)
                        end do
                    end if
                    call check(idx >= 1 .and. idx <= nreq, "Wait/Testany: a 1-based index")
                    if (idx < 1 .or. idx > nreq) exit
                    call check(.not. seen(idx), "Wait/Testany: each request once")
                    seen(idx) = .true.
                    if (idx == 2) call check(SOURCE1(st) == left .and. TAG1(st) == tag, &
                        & "Wait/Testany: the receive's status")
                end do
                call MPI_Waitany(nreq, reqs, idx, st, ierr)
                ! MPICH 4.0's own binding adds 1 to MPI_UNDEFINED too.
                call check(idx == MPI_UNDEFINED .or. (is_mpich .and. idx == MPI_UNDEFINED + 1), &
                    & "MPI_Waitany with nothing left: MPI_UNDEFINED")
            case default
                seen = .false.
                seen(4) = .true.
                left_loop: do
                    if (how == 4) then
                        call MPI_Waitsome(nreq, reqs, outcount, indices, sts, ierr)
                    else
                        call MPI_Testsome(nreq, reqs, outcount, indices, MPI_STATUSES_IGNORE, &
                            & ierr)
                    end if
                    if (outcount == MPI_UNDEFINED) exit left_loop
                    do i = 1, outcount
                        idx = indices(i)
                        call check(idx >= 1 .and. idx <= nreq, "Wait/Testsome: 1-based indices")
                        if (idx < 1 .or. idx > nreq) exit left_loop
                        call check(.not. seen(idx), "Wait/Testsome: each request once")
                        seen(idx) = .true.
                        if (idx == 2 .and. how == 4) call check(SOURCE_OF(sts, i) == left &
                            & .and. TAG_OF(sts, i) == tag, "MPI_Waitsome: the receive's status")
                    end do
                end do left_loop
                call check(all(seen), "Wait/Testsome: every request completed")
            end select
            call check(ierr == MPI_SUCCESS, "a Wait/Test call returned an error")
            call check(all(reqs == MPI_REQUEST_NULL), "every request is MPI_REQUEST_NULL")
            call check(all(recvv == left * 100 + how), "the native receive's data")
            ! bc_ref: the Iallgather's send buffer and what the Ibcast's buffer held before.
            ag_ref = -7
            call ref_allgather(bc_ref, k, ag_ref, MPI_COMM_WORLD)
            call check(all(ag == ag_ref), "MPI_Iallgather in a mixed array differs")
            call ref_bcast(bc_ref, k, MPI_INTEGER, mod(how, nranks), MPI_COMM_WORLD)
            call check(all(bc == bc_ref), "MPI_Ibcast in a mixed array differs from the native Bcast")
            call ref_alltoall(a2a, 50, a2a_ref, MPI_COMM_WORLD)
            call check(all(a2a_out == a2a_ref), "MPI_Ialltoall in a mixed array differs")
        end do
    end subroutine
end program
