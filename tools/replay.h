/* cubuf replay (replay.c), a subcommand of the cubuf tool. */
#ifndef CUBUF_TOOL_REPLAY_H
#define CUBUF_TOOL_REPLAY_H

/* Runs `cubuf replay` with the arguments after "replay"; returns the exit status. */
int cubuf__replay(int argc, char **argv);

#endif
