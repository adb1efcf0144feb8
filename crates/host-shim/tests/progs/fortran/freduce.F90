! The SP-tree allreduce called from Fortran (include 'mpif.h'): MPI_ALLREDUCE and
! MPI_IALLREDUCE on MPI_INTEGER (SUM, MAX, BXOR), MPI_INTEGER8 (SUM, BAND), MPI_DOUBLE_PRECISION
! (SUM, MIN) and MPI_REAL (MAX, PROD), with MPI_IN_PLACE, on MPI_COMM_WORLD and a split half,
! counts from a seed (0 included), and MPI_LOGICAL with MPI_LOR (native). Each result is compared
! with the library's own Fortran PMPI_ALLREDUCE on the same inputs: integers exactly, double sums
! within 2 (n-1) eps sum|x_i|, real products within 2 (n-1) eps |p|, min/max exactly; and with
! rank 0's result (one result on every rank).
!
! Usage: freduce [ROUNDS [SEED]]. Prints "freduce: all ok (N checks on rank 0, S ranks, E
! eligible calls per rank)" (E: the calls the shim offloads with SPOFF_ALLREDUCE_DESIGN=sp-tree,
! the verdict's own MPI_ALLREDUCE included).
program freduce
    implicit none
    include 'mpif.h'
    integer :: ierr, rank, nproc, half, rounds, r, failures, checks, eligible, total, seed
    character(len=32) :: arg
    integer(kind=8) :: state

    call MPI_Init(ierr)
    call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
    call MPI_Comm_size(MPI_COMM_WORLD, nproc, ierr)
    rounds = 6
    seed = 1
    if (command_argument_count() >= 1) then
        call get_command_argument(1, arg)
        read (arg, *) rounds
    end if
    if (command_argument_count() >= 2) then
        call get_command_argument(2, arg)
        read (arg, *) seed
    end if
    failures = 0
    checks = 0
    eligible = 0
    call MPI_Comm_split(MPI_COMM_WORLD, mod(rank, 2), nproc - rank, half, ierr)
    do r = 1, rounds
        state = int(seed, 8) * 7919 + int(r, 8) * 104729
        call round(MPI_COMM_WORLD)
        state = int(seed, 8) * 7919 + int(r, 8) * 104729
        call round(half)
    end do
    call MPI_Comm_free(half, ierr)
    call MPI_Allreduce(failures, total, 1, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD, ierr)
    eligible = eligible + 1
    if (rank == 0) then
        if (total == 0) then
            write (*, '(a,i0,a,i0,a,i0,a)') 'freduce: all ok (', checks, ' checks on rank 0, ', &
                nproc, ' ranks, ', eligible, ' eligible calls per rank)'
        else
            write (*, '(a,i0,a)') 'freduce: ', total, ' failures'
        end if
    end if
    call MPI_Finalize(ierr)
    if (total /= 0) stop 1

contains

    ! The same on every rank of a communicator: a count from the shared state.
    integer function pick(n)
        integer, intent(in) :: n
        state = mod(state * 1103 + 12345, 2147483_8)
        pick = int(mod(state, int(n, 8)))
    end function pick

    subroutine check(ok, what)
        logical, intent(in) :: ok
        character(len=*), intent(in) :: what
        checks = checks + 1
        if (.not. ok) then
            failures = failures + 1
            if (failures < 10) write (0, '(a,i0,a,a)') 'rank ', rank, ': check failed: ', what
        end if
    end subroutine check

    subroutine round(comm)
        integer, intent(in) :: comm
        integer :: n, k, i, req, csize
        integer, allocatable :: ia(:), ib(:), iref(:)
        integer(kind=8), allocatable :: la(:), lb(:), lref(:)
        double precision, allocatable :: da(:), db(:), dref(:), dabs(:), dsum(:)
        real, allocatable :: ra(:), rb(:), rref(:), r0(:)
        logical, allocatable :: ga(:), gb(:), gref(:)
        double precision :: bound

        call MPI_Comm_size(comm, csize, ierr)
        select case (pick(3))
        case (0)
            n = 0
        case (1)
            n = 1 + pick(7)
        case default
            n = 1 + pick(2000)
        end select
        allocate (ia(max(n, 1)), ib(max(n, 1)), iref(max(n, 1)))
        allocate (la(max(n, 1)), lb(max(n, 1)), lref(max(n, 1)))
        allocate (da(max(n, 1)), db(max(n, 1)), dref(max(n, 1)), dabs(max(n, 1)), dsum(max(n, 1)))
        allocate (ra(max(n, 1)), rb(max(n, 1)), rref(max(n, 1)), r0(max(n, 1)))
        allocate (ga(max(n, 1)), gb(max(n, 1)), gref(max(n, 1)))
        do i = 1, n
            ia(i) = int(mod(int(i, 8) * 7919 + int(rank, 8) * 104729 + state, 100003_8)) - 50000
            la(i) = int(ia(i), 8) * 4294967311_8 + rank
            da(i) = dble(ia(i)) / 1024.0d0
            ra(i) = 0.5 + real(mod(i + rank * 13, 97)) / 64.0
            ga(i) = mod(i + rank, 3) == 0
        end do

        ! INTEGER SUM, blocking.
        call MPI_Allreduce(ia, ib, n, MPI_INTEGER, MPI_SUM, comm, ierr)
        call PMPI_Allreduce(ia, iref, n, MPI_INTEGER, MPI_SUM, comm, ierr)
        eligible = eligible + 1
        call check(all_eq_i(ib, iref, n), 'integer sum')
        ! INTEGER MAX in place, nonblocking.
        ib(1:n) = ia(1:n)
        call MPI_Iallreduce(MPI_IN_PLACE, ib, n, MPI_INTEGER, MPI_MAX, comm, req, ierr)
        call MPI_Wait(req, MPI_STATUS_IGNORE, ierr)
        call PMPI_Allreduce(ia, iref, n, MPI_INTEGER, MPI_MAX, comm, ierr)
        eligible = eligible + 1
        call check(all_eq_i(ib, iref, n), 'integer max in place')
        ! INTEGER BXOR, nonblocking.
        call MPI_Iallreduce(ia, ib, n, MPI_INTEGER, MPI_BXOR, comm, req, ierr)
        call MPI_Wait(req, MPI_STATUS_IGNORE, ierr)
        call PMPI_Allreduce(ia, iref, n, MPI_INTEGER, MPI_BXOR, comm, ierr)
        eligible = eligible + 1
        call check(all_eq_i(ib, iref, n), 'integer bxor')
        ! INTEGER*8 SUM and BAND.
        call MPI_Allreduce(la, lb, n, MPI_INTEGER8, MPI_SUM, comm, ierr)
        call PMPI_Allreduce(la, lref, n, MPI_INTEGER8, MPI_SUM, comm, ierr)
        eligible = eligible + 1
        call check(n == 0 .or. all(lb(1:n) == lref(1:n)), 'integer8 sum')
        call MPI_Allreduce(la, lb, n, MPI_INTEGER8, MPI_BAND, comm, ierr)
        call PMPI_Allreduce(la, lref, n, MPI_INTEGER8, MPI_BAND, comm, ierr)
        eligible = eligible + 1
        call check(n == 0 .or. all(lb(1:n) == lref(1:n)), 'integer8 band')
        ! DOUBLE PRECISION SUM (bounded) and MIN (exact).
        call MPI_Allreduce(da, db, n, MPI_DOUBLE_PRECISION, MPI_SUM, comm, ierr)
        call PMPI_Allreduce(da, dref, n, MPI_DOUBLE_PRECISION, MPI_SUM, comm, ierr)
        dabs(1:n) = abs(da(1:n))
        call PMPI_Allreduce(dabs, dsum, n, MPI_DOUBLE_PRECISION, MPI_SUM, comm, ierr)
        eligible = eligible + 1
        k = 0
        do i = 1, n
            bound = 2.0d0 * (csize - 1) * epsilon(1.0d0) * dsum(i)
            if (abs(db(i) - dref(i)) > bound) k = k + 1
        end do
        call check(k == 0, 'double sum within the bound')
        call MPI_Allreduce(da, db, n, MPI_DOUBLE_PRECISION, MPI_MIN, comm, ierr)
        call PMPI_Allreduce(da, dref, n, MPI_DOUBLE_PRECISION, MPI_MIN, comm, ierr)
        eligible = eligible + 1
        call check(n == 0 .or. all(db(1:n) == dref(1:n)), 'double min')
        ! REAL PROD (bounded), in place, and the same bytes as rank 0's.
        rb(1:n) = ra(1:n)
        call MPI_Allreduce(MPI_IN_PLACE, rb, n, MPI_REAL, MPI_PROD, comm, ierr)
        call PMPI_Allreduce(ra, rref, n, MPI_REAL, MPI_PROD, comm, ierr)
        eligible = eligible + 1
        k = 0
        do i = 1, n
            bound = 2.0d0 * (csize - 1) * epsilon(1.0) * abs(rref(i)) * 1.001d0
            if (abs(dble(rb(i)) - dble(rref(i))) > bound) k = k + 1
        end do
        call check(k == 0, 'real prod within the bound')
        r0(1:n) = rb(1:n)
        call PMPI_Bcast(r0, n, MPI_REAL, 0, comm, ierr)
        call check(n == 0 .or. all(r0(1:n) == rb(1:n)), 'real prod is rank 0''s')
        ! LOGICAL LOR: native (not a type the SPs reduce).
        call MPI_Allreduce(ga, gb, n, MPI_LOGICAL, MPI_LOR, comm, ierr)
        call PMPI_Allreduce(ga, gref, n, MPI_LOGICAL, MPI_LOR, comm, ierr)
        call check(n == 0 .or. all(gb(1:n) .eqv. gref(1:n)), 'logical lor')
    end subroutine round

    logical function all_eq_i(a, b, n)
        integer, intent(in) :: a(:), b(:), n
        all_eq_i = n == 0
        if (n > 0) all_eq_i = all(a(1:n) == b(1:n))
    end function all_eq_i
end program freduce
