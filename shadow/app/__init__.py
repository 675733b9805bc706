"""The top floor: assembles processes from every wing below (`demo`: fleet + router + serve + load)."""
