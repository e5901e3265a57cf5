#!/bin/busybox sh
# /init of xtlock's test VM (`cargo xtask vm-test`, xtask/src/vm/guest.rs writes /etc/xtlock-vm/).
# Mounts the host's root read-only over 9p under a throwaway overlay, tmpfs on /tmp and /run
# like a node, the results folder read-write over 9p, loads the configured modules, runs
# /etc/xtlock-vm/run.sh as root chrooted into that root, and reports its exit status in
# $RESULTS/exit-status and as a serial line `xtlock-vm: exit-status N`. Then it reboots, which
# ends QEMU (-no-reboot); if this script dies, the kernel panics and reboots (panic=-1).
/bin/busybox --install -s
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
. /etc/xtlock-vm/conf

say() { echo "xtlock-vm: $*"; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
finish() {
    [ -n "$results_up" ] && echo "$1" >"/newroot$RESULTS/exit-status"
    sync
    say "exit-status $1"
    reboot -f
    sleep 5
}
die() {
    say "error: $*"
    finish 125
}
# insmod each module file (paths under /lib/modules/$RELEASE) unless already loaded.
load() {
    for m in "$@"; do
        name=${m##*/}
        name=${name%%.ko*}
        name=$(echo "$name" | tr - _)
        [ -d "/sys/module/$name" ] && continue
        insmod "/lib/modules/$RELEASE/$m" || die "insmod $m failed"
    done
}
nine_p() { # TAG DIR OPTIONS
    mount -t 9p -o "trans=virtio,version=9p2000.L,msize=$MSIZE,$3" "$1" "$2"
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
say "init: kernel $(uname -r), up $(uptime_s) s"

load $EARLY_MODULES
mkdir -p /host /overlay /newroot
nine_p hostroot /host "ro,cache=loose" || die "cannot mount the host's root (9p tag hostroot)"
mount -t tmpfs -o mode=755 overlay /overlay && mkdir /overlay/upper /overlay/work
mount -t overlay -o lowerdir=/host,upperdir=/overlay/upper,workdir=/overlay/work overlay /newroot ||
    die "cannot mount the overlay root"

# A guest of another architecture gets a root of its own packages as hostroot (see
# xtask/src/vm/userland.rs) and the host's root as hostfs, for the kernel's modules and the
# folders the run needs (KEEP), bound in at their host paths.
src=/host
if [ -n "$HOSTFS" ]; then
    mkdir -p /hostfs
    nine_p hostfs /hostfs "ro,cache=loose" || die "cannot mount the host's root (9p tag hostfs)"
    src=/hostfs
fi

# Modules beyond the initramfs come from the unpacked package on the host; the kernel's own
# module loader (request_module) runs busybox modprobe from this initramfs.
mount --bind "$src$MODULES_DIR" "/lib/modules/$RELEASE" || die "cannot bind $MODULES_DIR"
echo /sbin/modprobe >/proc/sys/kernel/modprobe

r=/newroot
mount -t proc proc $r/proc
mount -t sysfs sysfs $r/sys
mount -t devtmpfs devtmpfs $r/dev
mkdir -p $r/dev/pts $r/dev/shm
mount -t devpts devpts $r/dev/pts
mount -t tmpfs -o mode=1777 tmpfs $r/dev/shm
mount -t tmpfs -o mode=1777 tmpfs $r/tmp
mount -t tmpfs -o mode=755 tmpfs $r/run
mkdir -p $r/run/lock $r/run/xtlock-vm
[ -d $r/var/tmp ] && mount -t tmpfs -o mode=1777 tmpfs $r/var/tmp
mount -t tracefs tracefs $r/sys/kernel/tracing
mount -t debugfs debugfs $r/sys/kernel/debug 2>/dev/null
mount -t bpf bpf $r/sys/fs/bpf 2>/dev/null
mount -t cgroup2 cgroup2 $r/sys/fs/cgroup 2>/dev/null
# Host folders the run needs that the tmpfs mounts above hide (a target dir under /tmp...).
# With a root of its own, every one of them.
for p in $KEEP; do
    case "$HOSTFS:$p" in
    1:* | *:/tmp/* | *:/run/* | *:/var/tmp/* | *:/dev/shm/*)
        mkdir -p "$r$p" && mount --bind "$src$p" "$r$p" || die "cannot bind $p"
        ;;
    esac
done
# The unpacked packages' ld.so cache (no maintainer script made it).
[ -n "$HOSTFS" ] && { chroot $r /sbin/ldconfig || die "ldconfig failed"; }
mkdir -p "$r$RESULTS"
nine_p results "$r$RESULTS" "rw" || die "cannot mount the results folder (9p tag results)"
results_up=1

load $MODULES
ip link set lo up || die "cannot bring up lo"
hostname xtlock-vm
# The RTC gives the clock; a guest far behind the host (no RTC) takes the host's.
[ "$(date +%s)" -lt "$HOST_EPOCH" ] && date -s "@$HOST_EPOCH" >/dev/null
cp /etc/xtlock-vm/run.sh $r/run/xtlock-vm/run.sh
say "ready: up $(uptime_s) s, $(nproc) CPUs, $(date -u +%FT%TZ)"

chroot $r /bin/sh /run/xtlock-vm/run.sh
finish $?
