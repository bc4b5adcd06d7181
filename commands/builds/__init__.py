"""imgpipe.commands.builds: the build side, as a user or CI runs it on a workstation or the
head node.

One floor: none imports another (what two of them share sits in registry/ or site/):

    images          plan, build, push, self-test, the lock, what CI runs per merge
    mirror          ``imgpipe mirror``: an image copied into the site registry by digest
    baseimage       ``imgpipe base-image``: a Debian + Python base by debootstrap
    convert         an image of the catalog (or any reference) converted, and the lock's
                    record of its squashfs
    recipes         a bundle rendered for the lock's pins, published beside the image,
                    pulled on the cluster
    report          ``imgpipe report``: a results folder as plots and one page
    sandbox         ``imgpipe sandbox``: the local multi-host Slurm cluster
    reference       the reference pages generated from the code (docs/reference/)
"""
